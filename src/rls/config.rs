//! envoyproxy/ratelimit's config files, read unchanged: one domain per `*.yaml` file of a
//! directory (its `RUNTIME_ROOT/RUNTIME_SUBDIRECTORY/config`), compiled into the descriptor
//! trees [`super::matcher`] walks. tollgate's additions live in the same files: `algorithm` and
//! `capacity` in a `rate_limit`, several limits per descriptor (`limits:`), `failure`.
//! Every error names `file:line:col` (ARCHITECTURE.md, "The Envoy rate-limit service").

use std::collections::HashMap;
use std::num::NonZeroU64;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Deserialize;
use serde_saphyr::{Location, Spanned};

use crate::config::rls::failure_of;
use crate::limiter::algorithm::{MAX_LOG_ENTRIES, MAX_UNITS};
use crate::limiter::{Algorithm, FailurePolicy, Quota};
use crate::yaml::{parse_str_sized, ConfigError, Sized};

/// Most descriptor entries one domain file may hold (a bound on the parser's work).
pub const MAX_ENTRIES_PER_FILE: usize = 100_000;

/// Deepest nesting of `descriptors` (a request's descriptor has at most as many entries).
pub const MAX_DEPTH: usize = 32;

/// A YAML scalar read as text whatever its type (`value: 2061111111` or `value: true` are text
/// to envoyproxy/ratelimit, which reads them into Go strings).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Text(pub String);

impl<'de> Deserialize<'de> for Text {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Text;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Text, E> {
                Ok(Text(v.to_string()))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Text, E> {
                Ok(Text(v.to_string()))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Text, E> {
                Ok(Text(v.to_string()))
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Text, E> {
                Ok(Text(v.to_string()))
            }
            fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<Text, E> {
                Ok(Text(v.to_string()))
            }
        }
        d.deserialize_any(V)
    }
}

/// One domain file as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawDomain {
    /// The domain.
    pub domain: Option<Spanned<Text>>,
    /// The top-level descriptors.
    #[serde(default)]
    pub descriptors: Vec<Spanned<RawDescriptor>>,
    /// tollgate: failure policy of the domain's descriptors that name none.
    pub failure: Option<Spanned<String>>,
}

/// One descriptor entry as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawDescriptor {
    /// Required.
    pub key: Option<Spanned<Text>>,
    /// Optional; `*` matches any run of characters.
    pub value: Option<Spanned<Text>>,
    /// The limit.
    pub rate_limit: Option<Spanned<RawRateLimit>>,
    /// tollgate: more limits on the same descriptor, all checked (all or nothing).
    pub limits: Option<Vec<Spanned<RawLimit>>>,
    /// Nested descriptors.
    #[serde(default)]
    pub descriptors: Vec<Spanned<RawDescriptor>>,
    /// Never over the limit: counted, reported, never enforced.
    #[serde(default)]
    pub shadow_mode: bool,
    /// envoyproxy/ratelimit's quota mode: refused (not supported).
    pub quota_mode: Option<Spanned<bool>>,
    /// Metrics per value (bounded here: see [`super`]).
    #[serde(default)]
    pub detailed_metric: bool,
    /// The runtime value in the metric name.
    #[serde(default)]
    pub value_to_metric: bool,
    /// Every value a wildcard matches shares one counter.
    #[serde(default)]
    pub share_threshold: bool,
    /// Accepted and ignored (envoyproxy/ratelimit's response metadata).
    pub metadata: Option<serde::de::IgnoredAny>,
    /// tollgate: what happens when the store cannot answer.
    pub failure: Option<Spanned<String>>,
}

/// `rate_limit:` as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRateLimit {
    /// second | minute | hour | day | week | month | year (any case).
    pub unit: Option<Spanned<String>>,
    /// Units per `unit`; 0 denies every request.
    pub requests_per_unit: Option<Spanned<u64>>,
    /// No limit: answered OK at once.
    #[serde(default)]
    pub unlimited: bool,
    /// The name other descriptors' `replaces` refer to.
    pub name: Option<Spanned<String>>,
    /// Limits (by name) this one replaces when both match.
    #[serde(default)]
    pub replaces: Vec<Spanned<RawReplaces>>,
    /// tollgate: the algorithm (default `fixed_window`, envoyproxy/ratelimit's).
    pub algorithm: Option<Spanned<String>>,
    /// tollgate: buckets' capacity (default `requests_per_unit`).
    pub capacity: Option<Spanned<u64>>,
}

/// One of `replaces:`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawReplaces {
    /// The replaced limit's name.
    pub name: Option<Spanned<String>>,
}

/// One of tollgate's `limits:`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawLimit {
    /// As in `rate_limit`.
    pub unit: Spanned<String>,
    /// As in `rate_limit`.
    pub requests_per_unit: Spanned<u64>,
    /// As in `rate_limit`.
    pub algorithm: Option<Spanned<String>>,
    /// As in `rate_limit`.
    pub capacity: Option<Spanned<u64>>,
}

/// envoyproxy/ratelimit's units (the proto's numbers) and their length in seconds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// 1 s.
    Second,
    /// 60 s.
    Minute,
    /// 3600 s.
    Hour,
    /// 86400 s.
    Day,
    /// 7 days.
    Week,
    /// 30 days (envoyproxy/ratelimit's month).
    Month,
    /// 365 days (envoyproxy/ratelimit's year).
    Year,
}

impl Unit {
    /// Parse a unit, any case.
    pub fn parse(s: &str) -> Option<Unit> {
        Some(match s.to_ascii_lowercase().as_str() {
            "second" => Unit::Second,
            "minute" => Unit::Minute,
            "hour" => Unit::Hour,
            "day" => Unit::Day,
            "week" => Unit::Week,
            "month" => Unit::Month,
            "year" => Unit::Year,
            _ => return None,
        })
    }

    /// From the proto's enum number (0, unknown, is `None`).
    pub fn from_proto(n: i32) -> Option<Unit> {
        Some(match n {
            1 => Unit::Second,
            2 => Unit::Minute,
            3 => Unit::Hour,
            4 => Unit::Day,
            5 => Unit::Month,
            6 => Unit::Year,
            7 => Unit::Week,
            _ => return None,
        })
    }

    /// The proto's enum number.
    pub fn proto(self) -> i32 {
        match self {
            Unit::Second => 1,
            Unit::Minute => 2,
            Unit::Hour => 3,
            Unit::Day => 4,
            Unit::Month => 5,
            Unit::Year => 6,
            Unit::Week => 7,
        }
    }

    /// Its length in seconds.
    pub fn secs(self) -> u64 {
        match self {
            Unit::Second => 1,
            Unit::Minute => 60,
            Unit::Hour => 3600,
            Unit::Day => 86_400,
            Unit::Week => 7 * 86_400,
            Unit::Month => 30 * 86_400,
            Unit::Year => 365 * 86_400,
        }
    }

    /// Lower-case name, as written in the files.
    pub fn as_str(self) -> &'static str {
        match self {
            Unit::Second => "second",
            Unit::Minute => "minute",
            Unit::Hour => "hour",
            Unit::Day => "day",
            Unit::Week => "week",
            Unit::Month => "month",
            Unit::Year => "year",
        }
    }
}

/// One enforced limit of a descriptor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RlsLimit {
    /// What Envoy is told (`current_limit`).
    pub unit: Unit,
    /// What Envoy is told (`current_limit`).
    pub requests_per_unit: u32,
    /// The limiter's quota; `None` for `requests_per_unit: 0`, which denies every request
    /// without asking the store.
    pub quota: Option<Quota>,
}

impl RlsLimit {
    /// `requests_per_unit` per `unit` with `algorithm` (buckets hold `capacity`).
    pub fn new(unit: Unit, requests_per_unit: u32, algorithm: Algorithm, capacity: Option<u64>) -> Self {
        let window_us = unit.secs().saturating_mul(1_000_000);
        let quota = NonZeroU64::new(u64::from(requests_per_unit)).map(|n| {
            let window = NonZeroU64::new(window_us).unwrap_or(NonZeroU64::MIN);
            if algorithm.is_bucket() {
                let interval = NonZeroU64::new(window_us / n.get()).unwrap_or(NonZeroU64::MIN);
                let cap = capacity.and_then(NonZeroU64::new).unwrap_or(n);
                Quota::bucket(algorithm, cap, interval)
            } else {
                Quota::window(algorithm, n, window)
            }
        });
        RlsLimit {
            unit,
            requests_per_unit,
            quota,
        }
    }
}

/// A descriptor's limits, as matched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// `rate_limit.name`.
    pub name: String,
    /// Names of the limits this one replaces.
    pub replaces: Vec<String>,
    /// Answered OK, `limit_remaining` u32::MAX, without asking the store.
    pub unlimited: bool,
    /// Never over the limit.
    pub shadow: bool,
    /// Every limit (`rate_limit` first, then `limits:`); empty when `unlimited`.
    pub limits: Vec<RlsLimit>,
    /// What happens when the store cannot answer.
    pub failure: FailurePolicy,
    /// The metric name of the entry (`domain.key_value.key`), as envoyproxy/ratelimit's stats.
    pub metric: String,
    /// `detailed_metric`.
    pub detailed_metric: bool,
}

/// One node of a domain's descriptor tree.
#[derive(Debug, Default)]
pub struct Node {
    /// Children by `key_value` (or `key` for a key without a value), as envoyproxy/ratelimit
    /// keys its map.
    pub children: HashMap<String, Node>,
    /// Children whose `key_value` has a `*`: the pattern, split on `*`, in file order.
    pub wildcards: Vec<(String, Vec<String>)>,
    /// This entry's limits.
    pub limits: Option<Arc<Limits>>,
    /// `value_to_metric`.
    pub value_to_metric: bool,
    /// `share_threshold`: the entry's `key_value` pattern.
    pub share_pattern: Option<String>,
}

/// One domain file, compiled.
#[derive(Debug)]
pub struct Domain {
    /// The domain.
    pub name: String,
    /// The file it came from.
    pub file: PathBuf,
    /// Top-level descriptors.
    pub root: Node,
    /// Descriptor entries with a limit.
    pub limits: usize,
}

/// Every domain of the config directory.
#[derive(Debug, Default)]
pub struct Domains {
    /// By name.
    pub by_name: HashMap<String, Domain>,
    /// The files read, sorted.
    pub files: Vec<PathBuf>,
}

/// The `*.yaml` (and `*.yml`) files of `dir`, sorted; dot files are skipped.
pub fn files_of(dir: &Path) -> Result<Vec<PathBuf>, ConfigError> {
    let rd = std::fs::read_dir(dir)
        .map_err(|e| ConfigError::file(dir, format!("cannot read the rls config directory: {e}")))?;
    let mut files: Vec<PathBuf> = rd
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            !name.starts_with('.') && (name.ends_with(".yaml") || name.ends_with(".yml")) && p.is_file()
        })
        .collect();
    files.sort();
    Ok(files)
}

/// Read and compile every domain file of `dir`. `failure` is the policy of domains that name
/// none. Two files of one domain are an error (envoyproxy/ratelimit's default).
pub fn load_dir(dir: &Path, failure: FailurePolicy) -> Result<Domains, ConfigError> {
    let files = files_of(dir)?;
    let mut by_name: HashMap<String, Domain> = HashMap::new();
    for f in &files {
        let text = std::fs::read_to_string(f).map_err(|e| ConfigError::file(f, format!("cannot read: {e}")))?;
        let d = compile_domain(f, &text, failure)?;
        if let Some(other) = by_name.get(&d.name) {
            return Err(ConfigError::file(
                f,
                format!("duplicate domain {:?} (also in {})", d.name, other.file.display()),
            ));
        }
        by_name.insert(d.name.clone(), d);
    }
    Ok(Domains { by_name, files })
}

/// The parser's budget for one domain file.
const SIZE: Sized = Sized {
    entries: MAX_ENTRIES_PER_FILE,
    nodes_per_entry: 40,
    bytes_per_entry: 2_000,
    what: "the rls domain file",
};

/// Compile one domain file's text (named `file` in errors).
pub fn compile_domain(file: &Path, text: &str, failure: FailurePolicy) -> Result<Domain, ConfigError> {
    let raw: RawDomain = parse_str_sized(file, text, SIZE)?;
    let Some(domain) = &raw.domain else {
        return Err(ConfigError::file(
            file,
            "config file cannot have empty domain (domain: is missing)",
        ));
    };
    if domain.value.0.is_empty() {
        return Err(ConfigError::at(
            file,
            &domain.referenced,
            "config file cannot have empty domain",
        ));
    }
    let failure = failure_of(file, raw.failure.as_ref(), failure)?;
    let mut cx = Cx { file, count: 0 };
    let mut root = Node::default();
    let prefix = domain.value.0.clone();
    cx.load(&mut root, &prefix, &raw.descriptors, (failure, 1))?;
    Ok(Domain {
        name: domain.value.0.clone(),
        file: file.to_path_buf(),
        root,
        limits: cx.count,
    })
}

struct Cx<'a> {
    file: &'a Path,
    count: usize,
}

impl Cx<'_> {
    fn err(&self, loc: &Location, msg: impl Into<String>) -> ConfigError {
        ConfigError::at(self.file, loc, msg)
    }

    /// Load `list` under `node`; `parent` is the metric name so far, `(failure, depth)` the
    /// inherited policy and the level.
    fn load(
        &mut self,
        node: &mut Node,
        parent: &str,
        list: &[Spanned<RawDescriptor>],
        (failure, depth): (FailurePolicy, usize),
    ) -> Result<(), ConfigError> {
        if depth > MAX_DEPTH && !list.is_empty() {
            return Err(self.err(
                &list[0].referenced,
                format!("descriptors nested deeper than {MAX_DEPTH}"),
            ));
        }
        for d in list {
            let loc = &d.referenced;
            let r = &d.value;
            let key = match &r.key {
                Some(k) if !k.value.0.is_empty() => k.value.0.clone(),
                Some(k) => return Err(self.err(&k.referenced, "descriptor has empty key")),
                None => return Err(self.err(loc, "descriptor has empty key (key: is missing)")),
            };
            let value = r.value.as_ref().map(|v| v.value.0.clone()).unwrap_or_default();
            let final_key = if value.is_empty() {
                key.clone()
            } else {
                format!("{key}_{value}")
            };
            let metric = format!("{parent}.{final_key}");
            if node.children.contains_key(&final_key) {
                return Err(self.err(loc, format!("duplicate descriptor composite key {metric:?}")));
            }
            if let Some(q) = &r.quota_mode {
                if q.value {
                    return Err(self.err(&q.referenced, "quota_mode is not supported by tollgate"));
                }
            }
            let failure = failure_of(self.file, r.failure.as_ref(), failure)?;
            if r.share_threshold && !final_key.contains('*') {
                return Err(self.err(
                    loc,
                    format!("share_threshold can only be used with wildcard values (containing '*'), but found key {final_key:?}"),
                ));
            }
            self.count += 1;
            if self.count > MAX_ENTRIES_PER_FILE {
                return Err(self.err(loc, format!("more than {MAX_ENTRIES_PER_FILE} descriptors in one file")));
            }
            let limits = self.limits(r, failure, &metric)?;
            let mut child = Node {
                limits: limits.map(Arc::new),
                value_to_metric: r.value_to_metric,
                share_pattern: (r.share_threshold).then(|| final_key.clone()),
                ..Node::default()
            };
            self.load(&mut child, &metric, &r.descriptors, (failure, depth + 1))?;
            if final_key.contains('*') {
                let parts = final_key.split('*').map(str::to_string).collect();
                node.wildcards.push((final_key.clone(), parts));
            }
            node.children.insert(final_key, child);
        }
        Ok(())
    }

    /// The limits of one descriptor entry (`None`: it has none).
    fn limits(&self, r: &RawDescriptor, failure: FailurePolicy, metric: &str) -> Result<Option<Limits>, ConfigError> {
        let mut out = Limits {
            name: String::new(),
            replaces: Vec::new(),
            unlimited: false,
            shadow: r.shadow_mode,
            limits: Vec::new(),
            failure,
            metric: metric.to_string(),
            detailed_metric: r.detailed_metric,
        };
        let mut any = false;
        if let Some(rl) = &r.rate_limit {
            any = true;
            let v = &rl.value;
            out.unlimited = v.unlimited;
            out.name = v.name.as_ref().map(|n| n.value.clone()).unwrap_or_default();
            for rep in &v.replaces {
                let name = match &rep.value.name {
                    Some(n) if !n.value.is_empty() => n.value.clone(),
                    _ => return Err(self.err(&rep.referenced, "should not have an empty replaces entry")),
                };
                if name == out.name {
                    return Err(self.err(&rep.referenced, "replaces should not contain name of same descriptor"));
                }
                out.replaces.push(name);
            }
            let unit = v.unit.as_ref().map(|u| (Unit::parse(&u.value), u));
            if v.unlimited {
                if let Some((Some(_), u)) = unit {
                    return Err(self.err(&u.referenced, "should not specify rate limit unit when unlimited"));
                }
                if r.limits.is_some() {
                    return Err(self.err(&rl.referenced, "an unlimited descriptor cannot have limits:"));
                }
            } else {
                let unit = match unit {
                    Some((Some(u), _)) => u,
                    Some((None, u)) => {
                        return Err(self.err(&u.referenced, format!("invalid rate limit unit {:?}", u.value)))
                    }
                    None => return Err(self.err(&rl.referenced, "invalid rate limit unit '' (unit: is missing)")),
                };
                let rpu = v.requests_per_unit.as_ref();
                out.limits
                    .push(self.limit(unit, rpu, v.algorithm.as_ref(), v.capacity.as_ref(), &rl.referenced)?);
            }
        }
        if let Some(list) = &r.limits {
            any = true;
            for l in list {
                let v = &l.value;
                let unit = Unit::parse(&v.unit.value).ok_or_else(|| {
                    self.err(
                        &v.unit.referenced,
                        format!("invalid rate limit unit {:?}", v.unit.value),
                    )
                })?;
                out.limits.push(self.limit(
                    unit,
                    Some(&v.requests_per_unit),
                    v.algorithm.as_ref(),
                    v.capacity.as_ref(),
                    &l.referenced,
                )?);
            }
            if list.is_empty() {
                return Err(self.err(
                    &r.key.as_ref().map_or(Location::UNKNOWN, |k| k.referenced),
                    "limits: is empty",
                ));
            }
        }
        Ok(any.then_some(out))
    }

    fn limit(
        &self,
        unit: Unit,
        rpu: Option<&Spanned<u64>>,
        algorithm: Option<&Spanned<String>>,
        capacity: Option<&Spanned<u64>>,
        loc: &Location,
    ) -> Result<RlsLimit, ConfigError> {
        let n = rpu.map_or(0, |r| r.value);
        let n32 = u32::try_from(n).map_err(|_| {
            self.err(
                rpu.map_or(loc, |r| &r.referenced),
                "requests_per_unit is larger than 4294967295",
            )
        })?;
        let alg = match algorithm {
            None => Algorithm::FixedWindow,
            Some(a) => match Algorithm::parse(&a.value) {
                Some(Algorithm::LeakyBucket) | Some(Algorithm::Concurrency) => {
                    return Err(self.err(
                        &a.referenced,
                        format!(
                            "algorithm {:?} cannot be answered by a rate-limit service (it delays or holds requests)",
                            a.value
                        ),
                    ))
                }
                Some(alg) => alg,
                None => {
                    return Err(self.err(
                        &a.referenced,
                        format!(
                            "unknown algorithm {:?} (fixed_window | sliding_window | sliding_log | token_bucket)",
                            a.value
                        ),
                    ))
                }
            },
        };
        if alg == Algorithm::SlidingLog && n > MAX_LOG_ENTRIES {
            return Err(self.err(
                rpu.map_or(loc, |r| &r.referenced),
                format!("a sliding_log limit is at most {MAX_LOG_ENTRIES}"),
            ));
        }
        let cap = match capacity {
            Some(c) if !alg.is_bucket() => return Err(self.err(&c.referenced, "capacity is for token_bucket only")),
            Some(c) if c.value == 0 || c.value > MAX_UNITS => {
                return Err(self.err(&c.referenced, format!("capacity must be in 1..={MAX_UNITS}")))
            }
            Some(c) => Some(c.value),
            None => None,
        };
        if alg.is_bucket() && n == 0 {
            return Err(self.err(loc, "a token_bucket needs requests_per_unit of at least 1"));
        }
        if alg.is_bucket() && u64::from(n32) > unit.secs().saturating_mul(1_000_000) {
            return Err(self.err(loc, "a token_bucket refills at most one unit per microsecond"));
        }
        Ok(RlsLimit::new(unit, n32, alg, cap))
    }
}
