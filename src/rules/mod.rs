//! The compiled rule set and its matcher: `(request, identity) → limits to check`. Pure: no I/O.
//!
//! Rules are compiled once per load: path patterns are parsed into a trie of segments, so a
//! request visits only the rules whose path matches (a few, out of thousands) and formats one
//! hash per key value.
//!
//! **Most specific wins, per key kind; all key kinds apply.** Specificity orders by pattern class
//! (exact > template > prefix), then literal length (longer prefix first), then method-specific,
//! then tier-specific, then host/header conditions; ties go to the rule written first.

pub mod path;

use std::collections::{HashMap, HashSet};
use std::num::{NonZeroU32, NonZeroU64};
use std::path::Path;
use std::sync::Arc;

use http::{HeaderMap, HeaderName, Method};
use serde_saphyr::{Location, Spanned};
use sha2::Digest;

use crate::config::raw::{RawOverride, RawRule, RawRules, RawWindow};
use crate::config::{duration, ConfigError};
use crate::identity::{Identity, IdentityKind};
use crate::limiter::keys::{KeyBuilder, Namespace};
use crate::limiter::{Algorithm, FailurePolicy, Quota};
pub use path::{normalize, Pattern, PatternClass};

/// What one counter is shared by.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum KeyKind {
    /// The caller of §3: JWT user, else API key id, else client IP.
    User,
    /// The client IP (IPv6 /64), whoever the caller is.
    Ip,
    /// The caller's org; the rule does not apply without one.
    Org,
    /// One counter for everyone.
    Global,
    /// A request header's value (hashed); the rule does not apply without the header.
    Header(HeaderName),
}

impl KeyKind {
    /// Parse `user | ip | org | global | header:<Name>`.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "user" => KeyKind::User,
            "ip" => KeyKind::Ip,
            "org" => KeyKind::Org,
            "global" => KeyKind::Global,
            _ => {
                let name = s.strip_prefix("header:")?;
                KeyKind::Header(HeaderName::from_bytes(name.trim().as_bytes()).ok()?)
            }
        })
    }

    /// The config spelling.
    pub fn to_text(&self) -> String {
        match self {
            KeyKind::User => "user".into(),
            KeyKind::Ip => "ip".into(),
            KeyKind::Org => "org".into(),
            KeyKind::Global => "global".into(),
            KeyKind::Header(h) => format!("header:{h}"),
        }
    }
}

/// Specificity of a rule; larger is more specific.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Specificity {
    /// Exact > template > prefix.
    pub class: PatternClass,
    /// Literal bytes in the path pattern.
    pub literal_len: usize,
    /// Has `methods`.
    pub methods: bool,
    /// Has `tier`.
    pub tier: bool,
    /// Host and header conditions.
    pub extra: usize,
}

/// A compiled rule.
#[derive(Debug, Clone)]
pub struct Rule {
    /// Unique name (letters, digits, `_-.`).
    pub name: Arc<str>,
    /// Position in the file (ties go to the lower).
    pub index: usize,
    /// Path pattern.
    pub pattern: Pattern,
    /// Allowed methods; `None` = any.
    pub methods: Option<Vec<Method>>,
    /// Required tier.
    pub tier: Option<String>,
    /// Required host (lower-case, without port).
    pub host: Option<String>,
    /// Required header values.
    pub headers: Vec<(HeaderName, String)>,
    /// What the counter is shared by.
    pub key: KeyKind,
    /// The limits (several windows at once).
    pub limits: Vec<Quota>,
    /// Per-identity limits, by key id / user id / IP.
    pub overrides: HashMap<String, Vec<Quota>>,
    /// Units per request.
    pub cost: u64,
    /// What happens when the store is down.
    pub failure: FailurePolicy,
    /// Evaluate and report, never reject.
    pub shadow: bool,
    /// Specificity.
    pub specificity: Specificity,
    /// Line of the rule in its file.
    pub line: u64,
}

impl Rule {
    /// The limits that apply to `identity`: its override if any, else the rule's.
    pub fn limits_for(&self, identity: &Identity) -> &[Quota] {
        if !self.overrides.is_empty() {
            if let Some(o) = self.overrides.get(&*identity.id) {
                return o;
            }
        }
        &self.limits
    }

    fn matches(&self, req: &RequestInfo<'_>) -> bool {
        self.matches_conditions(req) && self.pattern.matches(req.path)
    }

    /// Everything but the path: methods, tier, host, headers.
    fn matches_conditions(&self, req: &RequestInfo<'_>) -> bool {
        if let Some(m) = &self.methods {
            if !m.iter().any(|x| x == req.method) {
                return false;
            }
        }
        if let Some(t) = &self.tier {
            if t.as_str() != req.tier {
                return false;
            }
        }
        if let Some(h) = &self.host {
            match req.host {
                Some(rh) if rh.eq_ignore_ascii_case(h) => {}
                _ => return false,
            }
        }
        for (name, want) in &self.headers {
            match req.headers.get(name) {
                Some(v) if v.as_bytes() == want.as_bytes() => {}
                _ => return false,
            }
        }
        true
    }
}

/// The parts of a request the matcher looks at.
#[derive(Debug, Clone, Copy)]
pub struct RequestInfo<'a> {
    /// Method.
    pub method: &'a Method,
    /// Normalised path (see [`normalize`]).
    pub path: &'a str,
    /// Host without port.
    pub host: Option<&'a str>,
    /// All headers.
    pub headers: &'a HeaderMap,
    /// The caller's tier.
    pub tier: &'a str,
}

/// A rule set compiled from one `rules.yaml`.
#[derive(Debug, Clone, Default)]
pub struct RuleSet {
    /// Rules in file order.
    pub rules: Vec<Rule>,
    /// Path patterns as a trie of segments: a lookup visits only rules whose path matches.
    trie: Node,
    /// Distinct key kinds, in a fixed order; `Selection` slots follow it.
    pub kinds: Vec<KeyKind>,
    /// Slot of each rule's key kind in `kinds`.
    kind_slot: Vec<u8>,
    /// SHA-256 (hex, 16 chars) of the file content.
    pub version: String,
}

/// One trie node: the rules whose path pattern reaches this segment.
#[derive(Debug, Clone, Default)]
struct Node {
    /// Children by literal segment.
    literal: HashMap<Box<str>, Node>,
    /// The child for `{param}` / `*`.
    any: Option<Box<Node>>,
    /// Rules whose pattern ends exactly here.
    end: Vec<u32>,
    /// Rules `<here>/**`: they match here and everything below.
    subtree: Vec<u32>,
}

impl Node {
    fn insert(&mut self, p: &Pattern, rule: u32) {
        let mut n = self;
        for seg in &p.segments {
            n = match seg {
                path::Segment::Literal(l) => n.literal.entry(Box::from(l.as_str())).or_default(),
                path::Segment::Any => n.any.get_or_insert_with(Box::default),
            };
        }
        if p.subtree {
            n.subtree.push(rule);
        } else {
            n.end.push(rule);
        }
    }

    /// Call `f` for every rule whose path pattern matches `rest` (a normalised path suffix).
    /// Recursion depth is bounded by the trie's depth, not the path's.
    fn walk(&self, rest: &str, f: &mut impl FnMut(u32)) {
        self.subtree.iter().for_each(|&i| f(i));
        let rest = rest.trim_start_matches('/');
        if rest.is_empty() {
            self.end.iter().for_each(|&i| f(i));
            return;
        }
        let (seg, tail) = rest.split_once('/').unwrap_or((rest, ""));
        if let Some(n) = self.literal.get(seg) {
            n.walk(tail, f);
        }
        if let Some(n) = &self.any {
            n.walk(tail, f);
        }
    }
}

/// The winning rule of each key kind for one request, by rule index.
pub type Selection = Vec<u32>;

/// Why one rule matched or lost, for `explain`.
#[derive(Debug, Clone)]
pub struct Candidate {
    /// Rule index.
    pub rule: u32,
    /// Whether it is the chosen rule of its key kind.
    pub chosen: bool,
}

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
}

impl Ctx<'_> {
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
        let d = duration(self.file, w)?;
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        if us < 1000 {
            return Err(self.err(&w.referenced, format!("rule {rule:?}: window must be at least 1ms")));
        }
        NonZeroU64::new(us).ok_or_else(|| self.err(&w.referenced, "window must be positive"))
    }

    /// Build the quotas from limit/window, limits:, or rate/capacity.
    #[allow(clippy::too_many_arguments)]
    fn quotas(
        &self,
        rule: &str,
        loc: &Location,
        alg: Algorithm,
        limit: &Option<Spanned<i64>>,
        window: &Option<Spanned<String>>,
        limits: &Option<Vec<Spanned<RawWindow>>>,
        rate: &Option<Spanned<String>>,
        capacity: &Option<Spanned<i64>>,
    ) -> Result<Vec<Quota>, ConfigError> {
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
                let mut seen = HashSet::new();
                for (q, lw) in out.iter().zip(ls) {
                    if !seen.insert(q.window_us) {
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
                        "rule {rule:?}: unknown algorithm {:?} (token_bucket | leaky_bucket | fixed_window | sliding_log | sliding_window)",
                        a.value
                    ),
                )
            }),
        }
    }
}

fn failure_policy(
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

impl RuleSet {
    /// Load and validate a rules file.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::file(path, format!("cannot read: {e}")))?;
        Self::from_str(path, &text)
    }

    /// Parse and validate rules text (`path` names it in errors).
    pub fn from_str(path: &Path, text: &str) -> Result<Self, ConfigError> {
        let raw: RawRules = crate::config::parse_str(path, text)?;
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
        let ctx = Ctx { file, default_alg };
        let mut rules: Vec<Rule> = Vec::new();
        let mut names: HashSet<String> = HashSet::new();
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
            if !names.insert(name.to_string()) {
                return Err(ctx.err(&r.name.referenced, format!("duplicate rule name {name:?}")));
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
            let limits = ctx.quotas(name, loc, alg, &r.limit, &r.window, &r.limits, &r.rate, &r.capacity)?;
            let cost = match &r.cost {
                Some(c) => ctx.positive(name, "cost", c)?.get(),
                None => 1,
            };
            let check_cost = |qs: &[Quota], at: &Location| -> Result<(), ConfigError> {
                for q in qs {
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
                let qs = ctx.quotas(name, &o.referenced, alg, &limit, &window, &limits_o, &rate, &capacity)?;
                check_cost(&qs, &o.referenced)?;
                overrides.insert(who.clone(), qs);
            }
            let m = &r.matcher;
            let pattern = Pattern::parse(&m.path.value)
                .map_err(|e| ctx.err(&m.path.referenced, format!("rule {name:?}: {e}")))?;
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
            rules.push(Rule {
                name: Arc::from(name),
                index,
                pattern,
                methods,
                tier: m.tier.clone(),
                host: m.host.as_ref().map(|h| h.to_ascii_lowercase()),
                headers,
                key,
                limits,
                overrides,
                cost,
                failure,
                shadow: r.shadow,
                specificity,
                line: loc.line(),
            });
        }
        // Unreachable rules: B is shadowed when an earlier-or-more-specific A of the same key kind
        // matches every request B matches.
        for b in &rules {
            for a in &rules {
                if a.index != b.index
                    && a.key == b.key
                    && covers(a, b)
                    && (a.specificity > b.specificity || (a.specificity == b.specificity && a.index < b.index))
                {
                    let loc = &raw.rules[b.index].referenced;
                    return Err(ctx.err(
                        loc,
                        format!(
                            "rule {:?} is unreachable: rule {:?} (line {}) matches every request it does and wins",
                            b.name, a.name, a.line
                        ),
                    ));
                }
            }
        }
        let mut set = RuleSet {
            rules,
            ..Default::default()
        };
        set.index();
        Ok(set)
    }

    fn index(&mut self) {
        let mut kinds: Vec<KeyKind> = self.rules.iter().map(|r| r.key.clone()).collect();
        kinds.sort_by_key(|k| k.to_text());
        kinds.dedup();
        self.kind_slot = self
            .rules
            .iter()
            .map(|r| kinds.iter().position(|k| *k == r.key).unwrap_or(0) as u8)
            .collect();
        self.kinds = kinds;
        let mut trie = Node::default();
        for (i, r) in self.rules.iter().enumerate() {
            trie.insert(&r.pattern, i as u32);
        }
        self.trie = trie;
    }

    /// The chosen rule of each key kind for `req` (rule indices, one per kind that matched).
    pub fn select(&self, req: &RequestInfo<'_>) -> Selection {
        let mut best: [Option<u32>; 8] = [None; 8];
        let mut extra: Vec<Option<u32>> = Vec::new();
        if self.kinds.len() > best.len() {
            extra = vec![None; self.kinds.len()];
        }
        self.trie.walk(req.path, &mut |i| {
            let slot = self.kind_slot[i as usize] as usize;
            let cur = if extra.is_empty() {
                &mut best[slot]
            } else {
                &mut extra[slot]
            };
            let r = &self.rules[i as usize];
            if let Some(c) = *cur {
                let c = &self.rules[c as usize];
                if c.specificity > r.specificity || (c.specificity == r.specificity && c.index < r.index) {
                    return;
                }
            }
            // The trie matched the path; check the other conditions.
            if r.matches_conditions(req) {
                *cur = Some(i);
            }
        });
        if extra.is_empty() {
            best.iter().flatten().copied().collect()
        } else {
            extra.into_iter().flatten().collect()
        }
    }

    /// Every rule that matches `req`, marking the chosen one of each kind (for `explain`).
    pub fn explain(&self, req: &RequestInfo<'_>) -> Vec<Candidate> {
        let chosen: HashSet<u32> = self.select(req).into_iter().collect();
        let mut out: Vec<Candidate> = (0..self.rules.len() as u32)
            .filter(|i| self.rules[*i as usize].matches(req))
            .map(|rule| Candidate {
                rule,
                chosen: chosen.contains(&rule),
            })
            .collect();
        out.sort_by_key(|c| {
            (
                self.kind_slot[c.rule as usize],
                std::cmp::Reverse(self.rules[c.rule as usize].specificity),
                c.rule,
            )
        });
        out
    }

    /// The rule named `name`.
    pub fn by_name(&self, name: &str) -> Option<&Rule> {
        self.rules.iter().find(|r| &*r.name == name)
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

/// The value a rule's counter is shared by, for this request; `None` when the rule does not
/// apply (no org, no header).
pub fn key_value<'a>(
    kind: &KeyKind,
    identity: &'a Identity,
    headers: &'a HeaderMap,
    ip_text: &'a str,
) -> Option<KeyValue<'a>> {
    Some(match kind {
        KeyKind::User => caller(identity),
        KeyKind::Ip => KeyValue::Value(Namespace::Ip, ip_text.as_bytes()),
        KeyKind::Org => KeyValue::Value(Namespace::Org, identity.org.as_deref()?.as_bytes()),
        KeyKind::Global => KeyValue::Global,
        KeyKind::Header(h) => KeyValue::Value(Namespace::Header, headers.get(h)?.as_bytes()),
    })
}

/// The caller of §3 as a key value: its id, in the namespace of its identity kind.
pub fn caller(identity: &Identity) -> KeyValue<'_> {
    let ns = match identity.kind {
        IdentityKind::Jwt => Namespace::Jwt,
        IdentityKind::ApiKey => Namespace::ApiKey,
        IdentityKind::Ip => Namespace::Ip,
    };
    KeyValue::Value(ns, identity.id.as_bytes())
}

/// A key value borrowed from the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyValue<'a> {
    /// A value (user id, key id, IP, org, header bytes) in its namespace.
    Value(Namespace, &'a [u8]),
    /// The one global counter (keyed by rule name).
    Global,
}

impl KeyValue<'_> {
    /// The store tag of this value for `rule` (see [`KeyBuilder`]).
    pub fn tag(&self, keys: &KeyBuilder, rule: &str) -> String {
        match self {
            KeyValue::Value(ns, v) => keys.tag(*ns, v),
            KeyValue::Global => keys.global_tag(rule),
        }
    }
}

/// Humantime-ish rendering of a window for headers and bodies (`1m`, `15m`, `1s`, `250ms`).
pub fn window_text(us: u64) -> String {
    WindowText(us).to_string()
}

/// [`window_text`] without the allocation, for writing into a buffer.
#[derive(Debug, Clone, Copy)]
pub struct WindowText(pub u64);

impl WindowText {
    /// The number and unit of the text: `(90, "s")` for 90 seconds. The largest unit that
    /// divides the window evenly (d, h, m, s, else ms).
    pub fn parts(&self) -> (u64, &'static str) {
        let ms = self.0 / 1000;
        if ms != 0 && ms % 86_400_000 == 0 {
            (ms / 86_400_000, "d")
        } else if ms != 0 && ms % 3_600_000 == 0 {
            (ms / 3_600_000, "h")
        } else if ms != 0 && ms % 60_000 == 0 {
            (ms / 60_000, "m")
        } else if ms != 0 && ms % 1000 == 0 {
            (ms / 1000, "s")
        } else {
            (ms, "ms")
        }
    }
}

impl std::fmt::Display for WindowText {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (n, unit) = self.parts();
        write!(f, "{n}{unit}")
    }
}

#[cfg(test)]
mod tests;
