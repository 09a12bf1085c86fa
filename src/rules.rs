//! The compiled rule set and its matcher: `(request, identity) → limits to check`. Pure: no I/O.
//!
//! The types live here; `compile` validates a parsed file into them, `trie` matches requests.
//!
//! Rules are compiled once per load: path patterns are parsed into a trie of segments, so a
//! request visits only the rules whose path matches (a few, out of thousands) and formats one
//! hash per key value.
//!
//! **Most specific wins, per key kind; all key kinds apply.** Specificity orders by pattern class
//! (exact > template > prefix), then literal length (longer prefix first), then method-specific,
//! then tier-specific, then host/header conditions; ties go to the rule written first.

mod compile;
pub mod path;
pub mod raw;
pub mod runtime;
mod trie;

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;

use http::{HeaderMap, HeaderName, Method};

pub use crate::http::headers::{window_text, WindowText};
use crate::identity::{Identity, IdentityKind};
use crate::limiter::keys::{KeyBuilder, Namespace};
use crate::limiter::{FailurePolicy, Penalty, Quota};
pub use compile::{parse_rate, DEFAULT_MAX_RULES, DEFAULT_SLOT_TTL_US, MAX_PENALTY_US};
pub use path::{canonical, normalize, EncodedSlashes, PathError, Pattern, PatternClass};
use trie::Node;

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

/// `count_when.status`: exact codes and whole classes.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StatusMatch {
    /// Bit `n` set: every `n`xx status matches (n in 1..=5).
    pub classes: u8,
    /// Exact codes.
    pub codes: Vec<u16>,
}

impl StatusMatch {
    /// Does `status` match?
    pub fn matches(&self, status: u16) -> bool {
        let class = status / 100;
        (class < 8 && self.classes & (1 << class) != 0) || self.codes.contains(&status)
    }

    /// As written: `401, 5xx`.
    pub fn to_text(&self) -> String {
        let mut v: Vec<String> = self.codes.iter().map(u16::to_string).collect();
        v.extend(
            (1..=5)
                .filter(|c| self.classes & (1 << c) != 0)
                .map(|c| format!("{c}xx")),
        );
        v.join(", ")
    }
}

/// Where the upstream reports a request's real cost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CostSource {
    /// A response header, or a trailer of that name.
    Header(HeaderName),
    /// A number at a dotted path of the JSON response body, or of any event of an
    /// event-stream response (the largest found counts), read as the body streams through.
    Json(crate::usage::JsonPath),
}

impl std::fmt::Display for CostSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CostSource::Header(h) => write!(f, "header {h}"),
            CostSource::Json(p) => write!(f, "json {p}"),
        }
    }
}

/// `cost_from`: where the upstream reports a request's real cost (a response header or
/// trailer, or a JSON field of the response body).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CostFrom {
    /// Where the cost is reported.
    pub source: CostSource,
    /// Largest cost it may report; larger values count as this.
    pub max: u64,
    /// What the cost counts (`tokens`): the limit's `q` and `r` then count these units one by
    /// one, and `RateLimit-Policy` names them (`qu`). `None`: requests of `cost`.
    pub unit: Option<Arc<str>>,
    /// A whole, valid body without the number is charged `max` (`missing: max`), not the
    /// reservation: a client that can keep the upstream from reporting (a stream asked
    /// without usage) then gains nothing by it.
    pub missing_max: bool,
    /// The cap on this rule's requests in flight per key (`cost_from.in_flight`), as a
    /// concurrency quota: what a key can spend before its requests settle is at most this many
    /// times `max - cost`. `None` when `max` is the estimate (nothing to settle upwards).
    pub in_flight: Option<crate::limiter::Quota>,
}

impl CostFrom {
    /// The header that reports the cost, when it is one.
    pub fn header(&self) -> Option<&HeaderName> {
        match &self.source {
            CostSource::Header(h) => Some(h),
            CostSource::Json(_) => None,
        }
    }

    /// The JSON path that reports the cost, when it is one.
    pub fn json(&self) -> Option<&crate::usage::JsonPath> {
        match &self.source {
            CostSource::Json(p) => Some(p),
            CostSource::Header(_) => None,
        }
    }

    /// The cost a header value reports, capped at `max`; `None` when it is not a whole number.
    pub fn parse(&self, v: &http::HeaderValue) -> Option<u64> {
        self.parse_all(std::iter::once(v))
    }

    /// The cost every field line of the header reports (lines and comma-separated elements are
    /// one list), capped at `max`: the largest element, so a report sent twice never costs less
    /// than either; a whole number too large for 64 bits is above `max`. `None` when there is
    /// no element, or one is not a whole number (the estimate then stays spent).
    pub fn parse_all<'a>(&self, values: impl IntoIterator<Item = &'a http::HeaderValue>) -> Option<u64> {
        let mut cost: Option<u64> = None;
        for v in values {
            for e in v.to_str().ok()?.split(',') {
                let e = e.trim();
                if e.is_empty() {
                    continue;
                }
                let digits = e.strip_prefix('+').unwrap_or(e);
                if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
                    return None;
                }
                let n = digits.parse::<u64>().unwrap_or(u64::MAX).min(self.max);
                cost = Some(cost.map_or(n, |c| c.max(n)));
            }
        }
        cost
    }
}

/// `estimate`: what a request reserves before it is forwarded, read from its JSON body (the
/// largest number at any of `paths`), at least 1 and at most the cost source's `max`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Estimate {
    /// Dotted paths into the request body (`max_tokens`).
    pub paths: Vec<crate::usage::JsonPath>,
    /// The reservation when a complete, valid body has none of the paths.
    pub default: u64,
    /// Paths of a multiplier (`n`): the reservation is the number found times the largest of
    /// these (1 when none is found).
    pub times: Vec<crate::usage::JsonPath>,
    /// How many bytes of the request body are read to find them. A body that does not end
    /// within them, is not valid JSON or is compressed reserves `max`.
    pub within: usize,
}

/// What one request spends of one limit: a fixed cost, or a reservation settled against the
/// cost the upstream reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Spend {
    /// Units reserved per request when there is no `estimate` (and the estimate's fallback).
    pub cost: u64,
    /// Where the real cost is reported.
    pub cost_from: Option<CostFrom>,
    /// The reservation read from the request body.
    pub estimate: Option<Estimate>,
}

/// A limit's spend, borrowed from its rule: the limit's own, or the rule's.
#[derive(Debug, Clone, Copy)]
pub struct SpendRef<'a> {
    /// Units per request (the fixed cost, or the estimate's stand-in before the body is read).
    pub cost: u64,
    /// Where the real cost is reported.
    pub cost_from: Option<&'a CostFrom>,
    /// The reservation read from the request body.
    pub estimate: Option<&'a Estimate>,
    /// Which spend it is: the limit's position when the limit has its own, else
    /// [`RULE_SPEND`]. Reservations of one spend settle against one reported cost.
    pub slot: u8,
}

/// The spend slot of a limit that spends as its rule says.
pub const RULE_SPEND: u8 = u8::MAX;

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
    /// `methods` also match a method-override header's method.
    pub method_override: bool,
    /// The path is matched without regard to case (its pattern's literals are lower case).
    pub ignore_case: bool,
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
    /// Penalty box: after this rule denies a key, the key stays denied for this long.
    pub penalty: Option<Penalty>,
    /// Its limits may be decided from this node's leases (`lease: false` opts out; shadow rules,
    /// penalty boxes and rules that settle after the response never lease).
    pub lease: bool,
    /// Only responses whose status matches spend quota (the reservation is refunded otherwise).
    pub count_when: Option<StatusMatch>,
    /// The real cost comes from the response: reserve `cost`, then settle the difference.
    pub cost_from: Option<CostFrom>,
    /// The reservation comes from the request body (`estimate`), settled by `cost_from`.
    pub estimate: Option<Estimate>,
    /// Limits that spend in their own way (`limits: [{…, cost_from: …}]`), by position; empty
    /// when every limit spends as the rule says. Past its end, or `None`: the rule's.
    pub limit_spends: Vec<Option<Spend>>,
    /// How specific the rule's match is: among rules of one kind, only the most specific match applies.
    pub specificity: Specificity,
    /// Line of the rule in its file.
    pub line: u64,
    /// The priority class its requests get under adaptive concurrency, with where it is
    /// written (line, column): checked against the gateway's classes when the rules load.
    pub priority: Option<(Arc<str>, u64, u64)>,
    /// `scope: global`, with where it is written (checked against `store.regions` when the
    /// rules load): its limits count every region's spend. `None`: this region's alone.
    pub global_scope: Option<(u64, u64)>,
    /// The rule part of its store keys: its name, and for a global rule `name@region` (set when
    /// the rules load, so each region's spend has its own counter).
    pub key_name: Arc<str>,
}

impl Rule {
    /// What one request spends of the rule's limit at position `n` (of its limits, or of an
    /// override's, by position).
    pub fn spend(&self, n: usize) -> SpendRef<'_> {
        match self.limit_spends.get(n) {
            Some(Some(s)) => SpendRef {
                cost: s.cost,
                cost_from: s.cost_from.as_ref(),
                estimate: s.estimate.as_ref(),
                slot: u8::try_from(n).unwrap_or(RULE_SPEND),
            },
            _ => SpendRef {
                cost: self.cost,
                cost_from: self.cost_from.as_ref(),
                estimate: self.estimate.as_ref(),
                slot: RULE_SPEND,
            },
        }
    }

    /// The spend of slot `slot` ([`SpendRef::slot`]).
    pub fn spend_of_slot(&self, slot: u8) -> SpendRef<'_> {
        self.spend(if slot == RULE_SPEND {
            usize::MAX
        } else {
            usize::from(slot)
        })
    }

    /// Every spend of the rule: its own, then each limit's.
    pub fn spends(&self) -> impl Iterator<Item = SpendRef<'_>> {
        std::iter::once(self.spend(usize::MAX)).chain(
            self.limit_spends
                .iter()
                .enumerate()
                .filter(|(_, s)| s.is_some())
                .map(|(n, _)| self.spend(n)),
        )
    }

    /// What the rate-limit headers of its limit at position `n` count ([`crate::http::headers::Unit`]).
    pub fn header_unit(&self, n: usize) -> crate::http::headers::Unit {
        let s = self.spend(n);
        match s.cost_from.and_then(|c| c.unit.clone()) {
            Some(name) => crate::http::headers::Unit {
                cost: 1,
                name: Some(name),
            },
            None => crate::http::headers::Unit {
                cost: s.cost,
                name: None,
            },
        }
    }

    /// Some limit settles against a reported cost (`cost_from`).
    pub fn settles_cost(&self) -> bool {
        self.spends().any(|s| s.cost_from.is_some())
    }

    /// Some limit reserves from the request body (`estimate`).
    pub fn estimates(&self) -> bool {
        self.spends().any(|s| s.estimate.is_some())
    }

    /// The cap on requests in flight per key of a rule that settles (`cost_from.in_flight`):
    /// the smallest of its cost sources' caps.
    pub fn in_flight_cap(&self) -> Option<Quota> {
        self.spends()
            .filter_map(|s| s.cost_from.and_then(|c| c.in_flight))
            .min_by_key(|q| q.limit)
    }

    /// The limits that apply to `identity`: its override if any, else the rule's.
    pub fn limits_for(&self, identity: &Identity) -> &[Quota] {
        self.limits_for_id(&identity.id)
    }

    /// The limits that apply to the identity `id` (key id, JWT user, IP): its override if
    /// any, else the rule's. The id is read as text only when the rule has overrides.
    pub fn limits_for_id(&self, id: &crate::identity::IdText) -> &[Quota] {
        if !self.overrides.is_empty() {
            if let Some(o) = self.overrides.get(id.as_str()) {
                return o;
            }
        }
        &self.limits
    }

    /// The rule's conditions and path both match.
    fn matches(&self, req: &RequestInfo<'_>) -> bool {
        let path = if self.ignore_case {
            lower(req.path)
        } else {
            Cow::Borrowed(req.path)
        };
        self.matches_conditions(req) && self.pattern.matches(&path)
    }

    /// Everything but the path: methods, tier, host, headers.
    fn matches_conditions(&self, req: &RequestInfo<'_>) -> bool {
        if let Some(m) = &self.methods {
            let overridden = |x: &Method| self.method_override && req.method_override == Some(x);
            if !m.iter().any(|x| x == req.method || overridden(x)) {
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

/// `path` in lower case; borrowed when it has no upper-case letter.
pub(crate) fn lower(path: &str) -> Cow<'_, str> {
    // A percent-escaped non-ASCII byte (`%80`..`%FF`) may spell a character whose case folds
    // to ASCII (KELVIN SIGN to `k`, LONG S to `s`): an upstream that routes by Unicode case
    // would read the rule's path.
    let non_ascii = path
        .as_bytes()
        .windows(2)
        .any(|w| w[0] == b'%' && matches!(w[1], b'8'..=b'9' | b'A'..=b'F' | b'a'..=b'f'));
    if non_ascii {
        return Cow::Owned(fold_escaped(path));
    }
    if path.bytes().any(|b| b.is_ascii_uppercase()) {
        Cow::Owned(path.to_ascii_lowercase())
    } else {
        Cow::Borrowed(path)
    }
}

/// `path` lower-cased, with each percent-escaped UTF-8 character whose Unicode case folding
/// (upper then lower case, as `str::to_uppercase`/`to_lowercase` in Python, Java and JS
/// routers) is ASCII replaced by that ASCII text. Other escapes stay (lower-cased).
fn fold_escaped(path: &str) -> String {
    let b = path.as_bytes();
    let hex = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let byte_at = |i: usize| -> Option<u8> {
        if b.get(i) == Some(&b'%') {
            Some(hex(*b.get(i + 1)?)? << 4 | hex(*b.get(i + 2)?)?)
        } else {
            None
        }
    };
    let mut out = String::with_capacity(path.len());
    let mut i = 0;
    while i < b.len() {
        if let Some(first) = byte_at(i).filter(|v| *v >= 0x80) {
            let len = match first {
                0xC0..=0xDF => 2,
                0xE0..=0xEF => 3,
                0xF0..=0xF7 => 4,
                _ => 1,
            };
            let bytes: Option<Vec<u8>> = (0..len).map(|k| byte_at(i + 3 * k)).collect();
            if let Some(c) = bytes
                .as_deref()
                .and_then(|v| std::str::from_utf8(v).ok())
                .and_then(|t| t.chars().next())
            {
                let folded: String = c.to_uppercase().collect::<String>().to_lowercase();
                if folded.is_ascii() {
                    out.push_str(&folded);
                    i += 3 * len;
                    continue;
                }
            }
            out.push_str(&path[i..i + 3].to_ascii_lowercase());
            i += 3;
            continue;
        }
        out.push(char::from(b[i]).to_ascii_lowercase());
        i += 1;
    }
    out
}

/// The method-override header names, in the order [`method_override`] reads them.
pub const METHOD_OVERRIDE_HEADERS: [&str; 3] = ["x-http-method-override", "x-http-method", "x-method-override"];

/// The method a request asks the upstream to run instead of its own, by the first of
/// `X-HTTP-Method-Override`, `X-HTTP-Method` and `X-Method-Override` it carries (upper-cased, as
/// the frameworks that honour them read them); `None` without one, or when it names no method.
pub fn method_override(headers: &HeaderMap) -> Option<Method> {
    let v = METHOD_OVERRIDE_HEADERS.iter().find_map(|n| headers.get(*n))?;
    let up = v.to_str().ok()?.trim().to_ascii_uppercase();
    Method::from_bytes(up.as_bytes()).ok()
}

/// The parts of a request the matcher looks at.
#[derive(Debug, Clone, Copy)]
pub struct RequestInfo<'a> {
    /// The request method, as sent (matched case-sensitively, RFC 9110 §9.1).
    pub method: &'a Method,
    /// The method a method-override header names (see [`method_override`]); looked for only
    /// when some rule reads it ([`RuleSet::uses_method_override`]).
    pub method_override: Option<&'a Method>,
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
    /// The same for `ignore_case` rules, whose literals are lower case.
    trie_ci: Node,
    /// Some rule matches its path without regard to case.
    pub uses_ignore_case: bool,
    /// Some rule with `methods` reads method-override headers.
    pub uses_method_override: bool,
    /// Distinct key kinds, in a fixed order; `Selection` slots follow it.
    pub kinds: Vec<KeyKind>,
    /// Slot of each rule's key kind in `kinds`.
    kind_slot: Vec<u32>,
    /// SHA-256 (hex, 16 chars) of the file content.
    pub version: String,
    /// Some rule matches on `host`: only then does a request's host need working out.
    pub uses_host: bool,
    /// Header names the rules read (`header:` keys and `headers` conditions; the method
    /// override names when a rule reads them), lower case: a request spelling one of them with
    /// `_` for `-` is refused (see [`underscore_spelling`]).
    pub read_headers: Vec<HeaderName>,
}

/// The first header of `headers` whose name has a `_` where `reads` has a `-` (`X_API_KEY` for
/// `x-api-key`): CGI-style upstreams (WSGI, FastCGI, PHP) read both as `HTTP_X_API_KEY`, so
/// tollgate and the upstream would read different credentials or keys. `None` when there is
/// none. Only called for requests that carry a name with `_`.
pub fn underscore_spelling<'a>(headers: &'a HeaderMap, reads: &[&HeaderName]) -> Option<&'a HeaderName> {
    headers.keys().find(|name| {
        let n = name.as_str().as_bytes();
        n.contains(&b'_')
            && reads.iter().any(|r| {
                let r = r.as_str().as_bytes();
                r.len() == n.len() && r.iter().zip(n).all(|(a, b)| a == b || (*a == b'-' && *b == b'_'))
            })
    })
}

impl RuleSet {
    /// Give every concurrency limit (overrides included) the slot time to live `ttl_us`
    /// (`store.concurrency_ttl`), which the stores use as the limit's window; so does the
    /// in-flight cap of a `cost_from` rule.
    pub fn with_slot_ttl(mut self, ttl_us: u64) -> Self {
        let ttl = std::num::NonZeroU64::new(ttl_us).unwrap_or(std::num::NonZeroU64::MIN);
        for r in &mut self.rules {
            let in_flight = r.cost_from.as_mut().and_then(|cf| cf.in_flight.as_mut());
            for q in r
                .limits
                .iter_mut()
                .chain(r.overrides.values_mut().flatten())
                .chain(in_flight)
            {
                if q.algorithm == crate::limiter::Algorithm::Concurrency {
                    q.window_us = ttl;
                    q.interval_us = ttl;
                }
            }
        }
        self
    }
}

/// The winning rule of each key kind for one request, by rule index (inline up to eight kinds:
/// no allocation per request).
pub type Selection = smallvec::SmallVec<[u32; 8]>;

/// Why one rule matched or lost, for `explain`.
#[derive(Debug, Clone)]
pub struct Candidate {
    /// Rule index.
    pub rule: u32,
    /// Whether it is the chosen rule of its key kind.
    pub chosen: bool,
}

/// The value a rule's counter is shared by, for this request; `None` when the rule does not
/// apply (no org, no header).
pub fn key_value<'a>(
    kind: &KeyKind,
    identity: &'a Identity,
    headers: &'a HeaderMap,
    ip_text: &'a [u8],
) -> Option<KeyValue<'a>> {
    Some(match kind {
        KeyKind::User => caller(identity),
        KeyKind::Ip => KeyValue::Value(Namespace::Ip, ip_text),
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
    pub fn tag(&self, keys: &KeyBuilder, rule: &str) -> crate::limiter::keys::Tag {
        match self {
            KeyValue::Value(ns, v) => keys.tag(*ns, v),
            KeyValue::Global => keys.global_tag(rule),
        }
    }
}

#[cfg(test)]
mod tests;
