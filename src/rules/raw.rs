//! Raw serde structs: exactly what the YAML says, before validation. Unknown fields are errors.
//! Fields that validation may refuse are [`Spanned`] so the error names line and column.

use std::collections::BTreeMap;

use serde::Deserialize;
use serde_saphyr::Spanned;

/// `rules.yaml`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRules {
    /// Defaults for every rule.
    #[serde(default)]
    pub defaults: RawDefaults,
    /// The rules.
    #[serde(default)]
    pub rules: Vec<Spanned<RawRule>>,
}

/// `defaults:`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawDefaults {
    /// Default algorithm.
    pub algorithm: Option<Spanned<String>>,
    /// Default failure policy.
    pub failure: Option<Spanned<String>>,
    /// Default local share.
    pub local_share: Option<Spanned<u32>>,
}

/// One rule.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRule {
    /// Unique name.
    pub name: Spanned<String>,
    /// What requests it applies to.
    #[serde(rename = "match")]
    pub matcher: RawMatch,
    /// What one counter is shared by.
    pub key: Spanned<String>,
    /// Algorithm (default from `defaults`).
    pub algorithm: Option<Spanned<String>>,
    /// Window algorithms: units per window.
    pub limit: Option<Spanned<i64>>,
    /// Window algorithms: the window.
    pub window: Option<Spanned<String>>,
    /// Several windows at once.
    pub limits: Option<Vec<Spanned<RawWindow>>>,
    /// Buckets: `N/s`, `N/m`, `N/h`.
    pub rate: Option<Spanned<String>>,
    /// Buckets: capacity.
    pub capacity: Option<Spanned<i64>>,
    /// Units per request.
    pub cost: Option<Spanned<i64>>,
    /// open | closed | local.
    pub failure: Option<Spanned<String>>,
    /// Nodes sharing the limit in `failure: local`.
    pub local_share: Option<Spanned<u32>>,
    /// Per-identity limits.
    #[serde(default)]
    pub overrides: BTreeMap<String, Spanned<RawOverride>>,
    /// Evaluate and report, never reject.
    #[serde(default)]
    pub shadow: bool,
    /// Penalty box: `10m`, or `{base: 1m, max: 1h}` to double on every breach during one.
    pub penalty: Option<Spanned<RawPenalty>>,
    /// `lease: false` keeps this rule's keys out of leases (`store.leases`).
    pub lease: Option<bool>,
    /// Only responses with these statuses spend quota.
    pub count_when: Option<Spanned<RawCountWhen>>,
    /// The real cost comes from a response header (or trailer), or a JSON field of the body.
    pub cost_from: Option<Spanned<RawCostFrom>>,
    /// What a request reserves before it is forwarded, read from its JSON body.
    pub estimate: Option<Spanned<RawEstimate>>,
    /// `calendar`: windows are the clock's days, weeks or months.
    pub align: Option<Spanned<String>>,
    /// The clock of a calendar window: `UTC` or `+HH:MM`.
    pub timezone: Option<Spanned<String>>,
    /// The priority class of the requests it matches (`upstream.adaptive.classes`).
    pub priority: Option<Spanned<String>>,
    /// `region` (default: this region's store alone) or `global` (every region's spend counts;
    /// `store.regions`).
    pub scope: Option<Spanned<String>>,
}

/// `count_when: {status: [401, 403, 5xx]}`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCountWhen {
    /// Status codes (`401`) or classes (`"4xx"`).
    pub status: Vec<RawStatus>,
}

/// One entry of `count_when.status`.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum RawStatus {
    /// An exact status code.
    Code(i64),
    /// A class: `1xx` … `5xx`.
    Class(String),
}

/// `cost_from: {header: X-Tokens-Used, max: 100000}` or `cost_from: {json: usage.total_tokens,
/// max: 100000}`: exactly one of `header` and `json`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawCostFrom {
    /// Response header (or trailer) carrying the real cost.
    pub header: Option<String>,
    /// Dotted path of the number in the JSON response body (or in an event of an
    /// event-stream response) carrying the real cost.
    pub json: Option<String>,
    /// Largest cost the header may report (larger values count as this).
    pub max: i64,
    /// What the cost counts, named in `RateLimit-Policy` (`qu`): `tokens` by default for
    /// `json`; none for `header` (its limits count requests of `cost`).
    pub unit: Option<String>,
    /// `json` only: what a whole, valid answer without the number is charged: `reservation`
    /// (the default) or `max`.
    pub missing: Option<Spanned<String>>,
    /// Most requests of one key in flight at once (the bound on what a key can spend before
    /// its requests settle is `in_flight × (max − cost)`); default `max(2, limit / (max − cost))`.
    pub in_flight: Option<Spanned<i64>>,
}

/// `estimate: {json: max_tokens, default: 1024, within: 1048576}`: the reservation read from the
/// request's JSON body.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawEstimate {
    /// Dotted path(s) of the number in the request body; the largest found counts.
    pub json: RawPaths,
    /// The reservation when the body has none of the paths.
    pub default: Spanned<i64>,
    /// Dotted path(s) of a multiplier in the request body (`n`: that many answers); the
    /// largest found counts, 1 when none is.
    pub times: Option<RawPaths>,
    /// How many bytes of the request body are read to find it (default 1 MiB).
    pub within: Option<Spanned<i64>>,
}

/// One dotted path, or several.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum RawPaths {
    /// `json: max_tokens`.
    One(String),
    /// `json: [max_tokens, max_completion_tokens]`.
    Many(Vec<String>),
}

/// `penalty:` — one duration, or a base and a maximum for escalation.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum RawPenalty {
    /// `penalty: 10m`.
    Fixed(String),
    /// `penalty: {base: 1m, max: 1h}`.
    Escalating {
        /// The first penalty.
        base: String,
        /// The longest.
        max: String,
    },
}

/// `match:`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawMatch {
    /// Path pattern.
    pub path: Spanned<String>,
    /// The methods matched (any when absent); upper-cased when compiled.
    pub methods: Option<Vec<Spanned<String>>>,
    /// The caller tier matched (any when absent).
    pub tier: Option<String>,
    /// The host pattern matched (any when absent); compared without port, case-insensitively.
    pub host: Option<String>,
    /// Exact header values.
    #[serde(default)]
    pub header: BTreeMap<String, String>,
    /// Match the path without regard to letter case (for upstreams that route that way).
    #[serde(default)]
    pub ignore_case: bool,
    /// `methods` also match the method named by `X-HTTP-Method-Override`, `X-HTTP-Method` or
    /// `X-Method-Override` (default true: upstreams that honour them run that method).
    pub method_override: Option<bool>,
}

/// One `{limit, window}`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawWindow {
    /// Units per window.
    pub limit: Spanned<i64>,
    /// The window's length, a duration such as `1m` or `1h`.
    pub window: Spanned<String>,
    /// What one request spends of this limit, when not the rule's `cost`.
    pub cost: Option<Spanned<i64>>,
    /// Where this limit's real cost comes from, when not the rule's `cost_from`.
    pub cost_from: Option<Spanned<RawCostFrom>>,
    /// What a request reserves of this limit, when not the rule's `estimate`.
    pub estimate: Option<Spanned<RawEstimate>>,
}

/// An override.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawOverride {
    /// Units per window.
    pub limit: Option<Spanned<i64>>,
    /// The overriding window's length (the rule's when absent).
    pub window: Option<Spanned<String>>,
    /// Several windows.
    pub limits: Option<Vec<Spanned<RawWindow>>>,
    /// Bucket rate.
    pub rate: Option<Spanned<String>>,
    /// Bucket capacity.
    pub capacity: Option<Spanned<i64>>,
}
