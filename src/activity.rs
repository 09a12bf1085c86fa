//! What the admin dashboard shows over time, kept in small bounded memory:
//!
//! * per rule, allowed / denied / shadow-denied **per second** over the last
//!   [`SERIES_SECONDS`], sampled once a second from the rule's Prometheus counters by a
//!   background task (`admin::dashboard`), so the request path does no extra work for it;
//! * the **most limited identity hashes** of the last [`LIMITED_WINDOW_SECS`]: updated only on a
//!   denial, from the hash already inside the denied counter's store key (no hashing, no
//!   allocation), in a fixed-size space-saving top-k per minute behind a mutex held for a short
//!   scan and never across an `.await`;
//! * the **history** of store / breaker states and of reloads (refused ones with their error),
//!   each a ring of the last few events.
//!
//! Raw identity values never reach this module: only the salted hashes of store keys.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

/// Seconds of per-rule history (one sample a second).
pub const SERIES_SECONDS: usize = 300;

/// Most rules that get a per-second series at once; busier configs chart the first rules that
/// see traffic (every rule's totals are still read live from its counters).
pub const MAX_CHARTED_RULES: usize = 200;

/// How far back "most limited" looks.
pub const LIMITED_WINDOW_SECS: u64 = 300;

/// Entries of one minute's top-k.
const TOPK_PER_MINUTE: usize = 32;

/// Minutes of top-k buckets kept (one more than the window, for the partial oldest minute).
const TOPK_MINUTES: usize = (LIMITED_WINDOW_SECS / 60) as usize + 1;

/// Store / breaker state changes kept.
const STORE_EVENTS: usize = 50;

/// Reloads kept.
const RELOAD_EVENTS: usize = 20;

/// Upstream seconds kept for its health (responses and failures per second).
const UPSTREAM_SECONDS: usize = 60;

/// Length of the hex hash of a store key (see `limiter::keys`).
const TAG_LEN: usize = 24;

/// One second of one rule: allowed, denied, shadow-denied (`would_deny`).
pub type Sample = [u32; 3];

/// The three counters a series samples, in [`Sample`] order.
pub type Totals = [u64; 3];

/// Per-rule series of the last [`SERIES_SECONDS`] seconds.
#[derive(Debug, Default)]
struct RuleSeries {
    /// The counters at the previous sample.
    last: Totals,
    /// One sample per second, oldest first; `None` until the rule sees traffic (or when the
    /// chart budget is spent), and again after a window without any.
    ring: Option<VecDeque<Sample>>,
}

/// One entry of a minute's space-saving top-k.
#[derive(Debug, Clone)]
struct Limited {
    /// The hex hash from the store key.
    tag: [u8; TAG_LEN],
    /// The rule that denied.
    rule: Arc<str>,
    /// The rule's key kind (`user`, `ip`, `org`, `header:X`).
    kind: &'static str,
    /// Denials counted (over-estimated by at most the count it replaced).
    count: u64,
    /// Unix second of the last denial.
    last_seen: u64,
}

/// One minute of the top-k.
#[derive(Debug, Default)]
struct Minute {
    /// Unix minute this bucket counts.
    minute: u64,
    /// At most [`TOPK_PER_MINUTE`] entries.
    entries: Vec<Limited>,
}

/// A change of the store's state (a breaker opened or closed, a failover moved a shard).
#[derive(Debug, Clone, serde::Serialize)]
pub struct StoreEvent {
    /// Unix seconds.
    pub at: u64,
    /// What happened, in words.
    pub what: String,
    /// `ok`, `degraded` or `down` after the change.
    pub state: &'static str,
}

/// One reload, kept for the dashboard.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ReloadEvent {
    /// Unix seconds.
    pub at: u64,
    /// What started it (`start`, `file change`, `SIGHUP`, `admin`, ...).
    pub trigger: &'static str,
    /// Was it applied?
    pub ok: bool,
    /// The rules version in force afterwards.
    pub version: String,
    /// Did anything change?
    pub changed: bool,
    /// Rules added / removed / changed, when applied.
    pub rules: Option<Changes>,
    /// Keys added / removed / changed, when applied.
    pub keys: Option<Changes>,
    /// Why it was refused.
    pub error: Option<String>,
}

/// One shard of the store as the dashboard shows it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ShardView {
    /// `host:port` (passwords never appear), or `memory`.
    pub addr: String,
    /// Is its circuit breaker open?
    pub breaker_open: bool,
    /// Times its breaker opened.
    pub opened_total: u64,
}

/// A limited identity hash with its rule, over the last [`LIMITED_WINDOW_SECS`].
#[derive(Debug, Clone, serde::Serialize)]
pub struct LimitedView {
    /// Salted hash (hex) of the identity value, as in the store key.
    pub hash: String,
    /// The rule that denied it.
    pub rule: String,
    /// The rule's key kind.
    pub key: &'static str,
    /// Denials in the window (an upper bound: space-saving over-counts evicted newcomers).
    pub denials: u64,
    /// Unix second of the last denial.
    pub last_seen: u64,
}

/// Rings of sampled values, touched once a second by the sampler and by dashboard reads.
#[derive(Debug, Default)]
struct Rings {
    /// Unix second of the newest sample (0 before the first).
    last_second: u64,
    /// By rule name.
    series: HashMap<Arc<str>, RuleSeries>,
    /// Rules with a ring now.
    charted: usize,
    /// Store state changes, oldest first.
    store_events: VecDeque<StoreEvent>,
    /// The shards at the last sample.
    shards: Vec<ShardView>,
    /// Store errors (error + timeout + circuit open) at the last sample, and per second.
    store_errors_last: u64,
    /// Store errors per second, last [`UPSTREAM_SECONDS`].
    store_errors: VecDeque<u32>,
    /// Reloads, oldest first.
    reloads: VecDeque<ReloadEvent>,
    /// Upstream (responses, failures) at the last sample.
    upstream_last: [u64; 2],
    /// Upstream (responses, failures) per second, last [`UPSTREAM_SECONDS`].
    upstream: VecDeque<[u32; 2]>,
    /// Unix second of the last upstream failure seen by the sampler.
    upstream_failed_at: Option<u64>,
}

/// What one sampling tick reads from the gateway.
#[derive(Debug, Clone)]
pub struct Tick<'a> {
    /// Unix seconds now.
    pub now: u64,
    /// Each current rule's name and counters.
    pub rules: Vec<(&'a Arc<str>, Totals)>,
    /// The store's shards now.
    pub shards: Vec<ShardView>,
    /// Store errors so far (every kind).
    pub store_errors: u64,
    /// Upstream responses and failures so far.
    pub upstream: [u64; 2],
}

/// A rule's series as the dashboard reads it.
#[derive(Debug, Clone, Default)]
pub struct SeriesView {
    /// Per second, oldest first, [`SERIES_SECONDS`] long (zeros where nothing happened), ending
    /// at `RingsView::last_second`; empty when the rule has no chart.
    pub per_second: Vec<Sample>,
    /// Sums over the series.
    pub sums: Totals,
}

/// Upstream health over the last minute, from the proxied traffic (no probes of its own).
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct UpstreamView {
    /// Responses in the last minute.
    pub responses: u64,
    /// Requests that got no response (refused, reset, timed out) in the last minute.
    pub failures: u64,
    /// Unix second of the last failure seen, if any.
    pub last_failure_at: Option<u64>,
}

/// See the module docs.
#[derive(Debug, Default)]
pub struct Activity {
    /// The sampler's current unix second, read (not computed) on the denial path.
    now: AtomicU64,
    /// Sampled series and histories.
    rings: Mutex<Rings>,
    /// Top-k per minute, ring of [`TOPK_MINUTES`].
    limited: Mutex<Vec<Minute>>,
}

/// Push `v` to a ring of at most `cap`.
fn push_capped<T>(ring: &mut VecDeque<T>, cap: usize, v: T) {
    if ring.len() == cap {
        ring.pop_front();
    }
    ring.push_back(v);
}

/// Saturating narrowing for per-second deltas.
fn delta(now: u64, before: u64) -> u32 {
    u32::try_from(now.saturating_sub(before)).unwrap_or(u32::MAX)
}

impl Activity {
    /// Empty history, starting at unix second `now`.
    pub fn new(now: u64) -> Self {
        let a = Activity::default();
        a.now.store(now, Ordering::Relaxed);
        a
    }

    /// Count a denial of the counter with hash `tag` by `rule` (key kind `kind`). The request
    /// path calls this on denials only: one atomic load, a short lock, a scan of at most
    /// [`TOPK_PER_MINUTE`] entries; no allocation unless a new (hash, rule) pair enters.
    pub fn denied(&self, tag: &str, rule: &Arc<str>, kind: &'static str) {
        let Ok(tag) = <[u8; TAG_LEN]>::try_from(tag.as_bytes()) else {
            return;
        };
        let now = self.now.load(Ordering::Relaxed);
        let minute = now / 60;
        let mut buckets = self.limited.lock();
        if buckets.is_empty() {
            buckets.resize_with(TOPK_MINUTES, Minute::default);
        }
        let slot = usize::try_from(minute % TOPK_MINUTES as u64).unwrap_or(0);
        let Some(b) = buckets.get_mut(slot) else {
            return;
        };
        if b.minute != minute {
            b.minute = minute;
            b.entries.clear();
        }
        if let Some(e) = b
            .entries
            .iter_mut()
            .find(|e| e.tag == tag && (Arc::ptr_eq(&e.rule, rule) || e.rule == *rule))
        {
            e.count += 1;
            e.last_seen = now;
            return;
        }
        let entry = Limited {
            tag,
            rule: rule.clone(),
            kind,
            count: 1,
            last_seen: now,
        };
        if b.entries.len() < TOPK_PER_MINUTE {
            b.entries.push(entry);
        } else if let Some(min) = b.entries.iter_mut().min_by_key(|e| e.count) {
            // Space-saving: the newcomer takes the smallest entry's place and count.
            let count = min.count + 1;
            *min = Limited { count, ..entry };
        }
    }

    /// The most limited (hash, rule) pairs of the last [`LIMITED_WINDOW_SECS`], most denials
    /// first, at most `n`.
    pub fn top_limited(&self, n: usize) -> Vec<LimitedView> {
        let now = self.now.load(Ordering::Relaxed);
        let oldest = now.saturating_sub(LIMITED_WINDOW_SECS) / 60;
        let mut merged: HashMap<([u8; TAG_LEN], Arc<str>), LimitedView> = HashMap::new();
        {
            let buckets = self.limited.lock();
            for b in buckets.iter().filter(|b| b.minute >= oldest && b.minute <= now / 60) {
                for e in &b.entries {
                    let v = merged.entry((e.tag, e.rule.clone())).or_insert_with(|| LimitedView {
                        hash: String::from_utf8_lossy(&e.tag).into_owned(),
                        rule: e.rule.to_string(),
                        key: e.kind,
                        denials: 0,
                        last_seen: 0,
                    });
                    v.denials += e.count;
                    v.last_seen = v.last_seen.max(e.last_seen);
                }
            }
        }
        let mut out: Vec<LimitedView> = merged.into_values().collect();
        out.sort_by(|a, b| b.denials.cmp(&a.denials).then(b.last_seen.cmp(&a.last_seen)));
        out.truncate(n);
        out
    }

    /// Record a reload (or the first load at start).
    pub fn reloaded(&self, event: ReloadEvent) {
        push_capped(&mut self.rings.lock().reloads, RELOAD_EVENTS, event);
    }

    /// The reloads kept, newest first.
    pub fn reloads(&self) -> Vec<ReloadEvent> {
        self.rings.lock().reloads.iter().rev().cloned().collect()
    }

    /// The unix second of the newest sample.
    pub fn now(&self) -> u64 {
        self.now.load(Ordering::Relaxed)
    }

    /// Take one sample (the sampler calls this once a second).
    pub fn sample(&self, tick: Tick<'_>) {
        self.now.store(tick.now, Ordering::Relaxed);
        let mut r = self.rings.lock();
        let first = r.last_second == 0;
        // Seconds since the previous sample: more than one when the sampler was late; the
        // counts of the gap land in the newest second, the others get zeros.
        let gap = if first {
            1
        } else {
            usize::try_from(tick.now.saturating_sub(r.last_second)).unwrap_or(SERIES_SECONDS)
        };
        if gap == 0 {
            return;
        }
        r.last_second = tick.now;
        let Rings { series, charted, .. } = &mut *r;
        let mut present: Vec<&str> = Vec::with_capacity(tick.rules.len());
        for (name, totals) in &tick.rules {
            present.push(name);
            let s = series.entry(Arc::clone(name)).or_insert_with(|| RuleSeries {
                last: if first { [0; 3] } else { *totals },
                ring: None,
            });
            let d: Sample = [
                delta(totals[0], s.last[0]),
                delta(totals[1], s.last[1]),
                delta(totals[2], s.last[2]),
            ];
            s.last = *totals;
            let active = d.iter().any(|&x| x > 0);
            if s.ring.is_none() && active && *charted < MAX_CHARTED_RULES {
                s.ring = Some(VecDeque::with_capacity(SERIES_SECONDS));
                *charted += 1;
            }
            if let Some(ring) = &mut s.ring {
                for _ in 1..gap.min(SERIES_SECONDS) {
                    push_capped(ring, SERIES_SECONDS, [0; 3]);
                }
                push_capped(ring, SERIES_SECONDS, d);
                if ring.iter().all(|x| *x == [0; 3]) && ring.len() == SERIES_SECONDS {
                    s.ring = None;
                    *charted -= 1;
                }
            }
        }
        // Rules that a reload removed.
        if series.len() > present.len() {
            let keep: std::collections::HashSet<&str> = present.into_iter().collect();
            series.retain(|k, s| {
                let kept = keep.contains(&**k);
                if !kept && s.ring.is_some() {
                    *charted -= 1;
                }
                kept
            });
        }
        // Store.
        let errors = delta(tick.store_errors, r.store_errors_last);
        r.store_errors_last = tick.store_errors;
        push_capped(&mut r.store_errors, UPSTREAM_SECONDS, if first { 0 } else { errors });
        if tick.shards != r.shards {
            let state = store_state(&tick.shards);
            for what in store_changes(&r.shards, &tick.shards, first) {
                push_capped(
                    &mut r.store_events,
                    STORE_EVENTS,
                    StoreEvent {
                        at: tick.now,
                        what,
                        state,
                    },
                );
            }
            r.shards = tick.shards;
        }
        // Upstream.
        let up = if first {
            [0, 0]
        } else {
            [
                delta(tick.upstream[0], r.upstream_last[0]),
                delta(tick.upstream[1], r.upstream_last[1]),
            ]
        };
        r.upstream_last = tick.upstream;
        if up[1] > 0 {
            r.upstream_failed_at = Some(tick.now);
        }
        push_capped(&mut r.upstream, UPSTREAM_SECONDS, up);
    }

    /// Rule `name`'s series, as of the last sample.
    pub fn series(&self, name: &str) -> SeriesView {
        let r = self.rings.lock();
        let Some(ring) = r.series.get(name).and_then(|s| s.ring.as_ref()) else {
            return SeriesView::default();
        };
        let mut per_second = vec![[0u32; 3]; SERIES_SECONDS - ring.len()];
        per_second.extend(ring.iter().copied());
        let mut sums = [0u64; 3];
        for s in ring {
            for (sum, x) in sums.iter_mut().zip(s) {
                *sum += u64::from(*x);
            }
        }
        SeriesView { per_second, sums }
    }

    /// The store's shards at the last sample, its state changes (newest first) and its errors
    /// in the last minute.
    pub fn store(&self) -> (Vec<ShardView>, Vec<StoreEvent>, u64) {
        let r = self.rings.lock();
        (
            r.shards.clone(),
            r.store_events.iter().rev().cloned().collect(),
            r.store_errors.iter().map(|&x| u64::from(x)).sum(),
        )
    }

    /// Upstream traffic in the last minute.
    pub fn upstream(&self) -> UpstreamView {
        let r = self.rings.lock();
        UpstreamView {
            responses: r.upstream.iter().map(|x| u64::from(x[0])).sum(),
            failures: r.upstream.iter().map(|x| u64::from(x[1])).sum(),
            last_failure_at: r.upstream_failed_at,
        }
    }
}

/// The key kind a denial is listed under in "most limited", `None` for a `global` rule (its
/// counter is everyone's, not an identity's).
pub fn limited_kind(key: &crate::rules::KeyKind) -> Option<&'static str> {
    use crate::rules::KeyKind;
    match key {
        KeyKind::User => Some("user"),
        KeyKind::Ip => Some("ip"),
        KeyKind::Org => Some("org"),
        KeyKind::Header(_) => Some("header"),
        KeyKind::Global => None,
    }
}

/// `ok` (every breaker closed), `degraded` (some open) or `down` (all open).
pub fn store_state(shards: &[ShardView]) -> &'static str {
    let open = shards.iter().filter(|s| s.breaker_open).count();
    match open {
        0 => "ok",
        n if n == shards.len() => "down",
        _ => "degraded",
    }
}

/// The events between two samples of the shards, in words.
fn store_changes(before: &[ShardView], after: &[ShardView], first: bool) -> Vec<String> {
    if first {
        let names: Vec<&str> = after.iter().map(|s| s.addr.as_str()).collect();
        return vec![format!("started: {} ({})", names.join(", "), store_state(after))];
    }
    let mut out = Vec::new();
    for s in after {
        match before.iter().find(|b| b.addr == s.addr) {
            None => out.push(format!("shard {} joined (failover or resharding)", s.addr)),
            Some(b) if b.breaker_open != s.breaker_open => out.push(if s.breaker_open {
                format!("shard {}: breaker opened", s.addr)
            } else {
                format!("shard {}: breaker closed, store answers again", s.addr)
            }),
            Some(b) if b.opened_total != s.opened_total => {
                out.push(format!("shard {}: breaker opened and closed again", s.addr))
            }
            Some(_) => {}
        }
    }
    for b in before {
        if !after.iter().any(|s| s.addr == b.addr) {
            out.push(format!("shard {} left (failover or resharding)", b.addr));
        }
    }
    out
}

/// Counts of added, removed and changed entries.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Changes {
    /// New entries.
    pub added: u64,
    /// Entries gone.
    pub removed: u64,
    /// Entries present before and after, but different.
    pub changed: u64,
}

impl Changes {
    /// Compare two maps of name → comparable value.
    pub(crate) fn between<K: Ord, V: PartialEq>(old: &BTreeMap<K, V>, new: &BTreeMap<K, V>) -> Self {
        let mut c = Changes::default();
        for (k, v) in new {
            match old.get(k) {
                None => c.added += 1,
                Some(o) if o != v => c.changed += 1,
                Some(_) => {}
            }
        }
        c.removed = old.keys().filter(|k| !new.contains_key(k)).count() as u64;
        c
    }

    pub(crate) fn any(&self) -> bool {
        *self != Changes::default()
    }
}

#[cfg(test)]
mod tests;
