//! `store.region` and `store.regions`, as written ([`RawRegions`]) and validated
//! ([`RegionsConfig`]), and the rules' scopes checked against them ([`rule_scopes`]).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use serde_saphyr::Spanned;

use crate::yaml::{duration, ConfigError};

/// `store.regions:` exactly as the YAML says it.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRegions {
    /// `sync` (default) or `budget`.
    pub mode: Option<Spanned<String>>,
    /// How often each region's spend of a global key is read from the others.
    pub sync_interval: Option<Spanned<String>>,
    /// `budget`: the fraction of an equal share every region keeps, whatever its recent use.
    pub budget_floor: Option<Spanned<f64>>,
    /// The other regions.
    #[serde(default)]
    pub peers: Vec<Spanned<RawPeer>>,
}

/// One entry of `store.regions.peers`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawPeer {
    /// The peer region's name (its own `store.region`).
    pub name: Spanned<String>,
    /// `redis` (default) or `redis_cluster`.
    pub kind: Option<Spanned<String>>,
    /// The peer region's store (cluster: any seeds).
    pub urls: Vec<Spanned<String>>,
    /// Name of an env var holding the peer store's password.
    pub password_env: Option<Spanned<String>>,
}

/// How a global limit is shared between regions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Every region spends against the whole limit, minus what the others last reported:
    /// over-admits by at most what the others spent since (`docs/regions.md`).
    Sync,
    /// The limit is split between regions by recent use: never over-admits, even partitioned.
    Budget,
}

impl Mode {
    /// Its name in the config.
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Sync => "sync",
            Mode::Budget => "budget",
        }
    }
}

/// One peer region, validated. Its `Debug` shows no URL (one may hold a password).
#[derive(Clone)]
pub struct PeerConfig {
    /// Its region name.
    pub name: Arc<str>,
    /// Its store is a Redis Cluster.
    pub cluster: bool,
    /// Its store's URLs.
    pub urls: Vec<String>,
    /// Its store's password, read from `password_env` (its `Debug` never shows it).
    pub password: Option<crate::yaml::Secret>,
}

/// `store.region` with `store.regions`, validated: the names are distinct and well formed,
/// every peer has a store, the interval and floor are in range.
#[derive(Debug, Clone)]
pub struct RegionsConfig {
    /// This gateway's region.
    pub name: Arc<str>,
    /// How global limits are shared.
    pub mode: Mode,
    /// How often the peers are read.
    pub sync_interval: Duration,
    /// `budget`: the fraction of an equal share every region keeps (0 to 1).
    pub budget_floor: f64,
    /// The other regions.
    pub peers: Vec<PeerConfig>,
}

/// A region name: letters, digits, `-`, `_`; at most 32 bytes (it is part of store keys).
fn region_name(s: &str) -> bool {
    !s.is_empty() && s.len() <= 32 && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
}

impl RegionsConfig {
    /// The share (ppm) a `budget` region has when it cannot know better: `floor / regions`.
    pub fn floor_ppm(&self) -> u64 {
        // budget_floor is validated to (0, 1].
        ((self.budget_floor * 1_000_000.0) as u64) / (self.peers.len() as u64 + 1)
    }

    /// Validate `store.region` / `store.regions` from `file`; `None` when neither is set.
    /// `redis` says whether the local store is Redis (a region needs one).
    pub fn compile(
        file: &Path,
        region: Option<&Spanned<String>>,
        raw: Option<&Spanned<RawRegions>>,
        redis: bool,
    ) -> Result<Option<Self>, ConfigError> {
        let err = |at: &serde_saphyr::Location, m: String| ConfigError::at(file, at, m);
        let (region, raw) = match (region, raw) {
            (None, None) => return Ok(None),
            (None, Some(r)) => {
                return Err(err(
                    &r.referenced,
                    "store.regions needs store.region: the name of this gateway's region".into(),
                ))
            }
            (Some(n), r) => (n, r),
        };
        if !region_name(&region.value) {
            return Err(err(
                &region.referenced,
                format!(
                    "store.region: {:?} is not a region name (letters, digits, '-', '_'; at most 32)",
                    region.value
                ),
            ));
        }
        if !redis {
            return Err(err(
                &region.referenced,
                "store.region needs a Redis store (kind: redis or redis_cluster): the memory store is one node's"
                    .into(),
            ));
        }
        let empty = RawRegions::default();
        let r = raw.map_or(&empty, |r| &r.value);
        let mode = match &r.mode {
            None => Mode::Sync,
            Some(m) => match m.value.as_str() {
                "sync" => Mode::Sync,
                "budget" => Mode::Budget,
                other => {
                    return Err(err(
                        &m.referenced,
                        format!("store.regions.mode: {other:?} is not sync or budget"),
                    ))
                }
            },
        };
        let sync_interval = match &r.sync_interval {
            None => Duration::from_millis(250),
            Some(s) => {
                let d = duration(file, s)?;
                if d < Duration::from_millis(10) || d > Duration::from_secs(60) {
                    return Err(err(
                        &s.referenced,
                        "store.regions.sync_interval must be between 10ms and 60s".into(),
                    ));
                }
                d
            }
        };
        // Above 0: a region that used nothing must still be able to spend (and so report use).
        let budget_floor = match &r.budget_floor {
            None => 0.5,
            Some(f) if f.value > 0.0 && f.value <= 1.0 => f.value,
            Some(f) => {
                return Err(err(
                    &f.referenced,
                    format!("store.regions.budget_floor: {} is not above 0 and at most 1", f.value),
                ))
            }
        };
        let mut peers: Vec<PeerConfig> = Vec::with_capacity(r.peers.len());
        for p in &r.peers {
            let p = &p.value;
            let name = &p.name;
            if !region_name(&name.value) {
                return Err(err(
                    &name.referenced,
                    format!("store.regions.peers: {:?} is not a region name", name.value),
                ));
            }
            // Case-blind: `US` beside `us` is a typo waiting to split a limit.
            if name.value.eq_ignore_ascii_case(&region.value)
                || peers.iter().any(|q| q.name.eq_ignore_ascii_case(&name.value))
            {
                return Err(err(
                    &name.referenced,
                    format!(
                        "store.regions.peers: region {:?} is named twice (this region is {:?})",
                        name.value, region.value
                    ),
                ));
            }
            let cluster = match p.kind.as_ref().map(|k| (k.value.as_str(), k)) {
                None | Some(("redis", _)) => false,
                Some(("redis_cluster", _)) => true,
                Some((other, k)) => {
                    return Err(err(
                        &k.referenced,
                        format!("store.regions.peers: kind {other:?} is not redis or redis_cluster"),
                    ))
                }
            };
            if p.urls.is_empty() {
                return Err(err(
                    &name.referenced,
                    format!("store.regions.peers: region {:?} needs urls", name.value),
                ));
            }
            for u in &p.urls {
                use redis::IntoConnectionInfo;
                let scheme = u.value.split_once("://").map(|(s, _)| s);
                if !matches!(scheme, Some("redis" | "rediss")) || u.value.as_str().into_connection_info().is_err() {
                    // Not echoed: a URL may hold a password.
                    return Err(err(
                        &u.referenced,
                        format!(
                            "store.regions.peers: region {:?}: not a redis:// or rediss:// URL",
                            name.value
                        ),
                    ));
                }
            }
            let password = match &p.password_env {
                Some(v) => Some(crate::yaml::Secret(crate::yaml::required_env(
                    file,
                    v,
                    "store.regions.peers.password_env",
                )?)),
                None => None,
            };
            peers.push(PeerConfig {
                name: Arc::from(name.value.as_str()),
                cluster,
                urls: p.urls.iter().map(|u| u.value.clone()).collect(),
                password,
            });
        }
        if peers.is_empty() {
            let at = raw.map_or(&region.referenced, |r| &r.referenced);
            return Err(err(
                at,
                "store.region needs store.regions.peers: at least one other region".into(),
            ));
        }
        Ok(Some(RegionsConfig {
            name: Arc::from(region.value.as_str()),
            mode,
            sync_interval,
            budget_floor,
            peers,
        }))
    }
}

/// Which rules are `scope: global`, checked against `regions`: a global rule needs
/// `store.region`, and counts with a fixed window on the epoch (not a calendar), the one
/// algorithm whose spend per window adds up across regions. An error names the rule's line.
pub fn rule_scopes(
    rules: &crate::rules::RuleSet,
    regions: Option<&RegionsConfig>,
    file: &Path,
) -> Result<Vec<bool>, ConfigError> {
    rules
        .rules
        .iter()
        .map(|r| {
            let Some((line, col)) = r.global_scope else {
                return Ok(false);
            };
            let at = |message: String| ConfigError {
                file: file.to_path_buf(),
                line,
                col,
                message,
            };
            if regions.is_none() {
                return Err(at(format!(
                    "rule {:?}: scope: global needs store.region and store.regions in the gateway file",
                    r.name
                )));
            }
            let fixed = |q: &crate::limiter::Quota| {
                q.algorithm == crate::limiter::Algorithm::FixedWindow && q.calendar.is_none()
            };
            if !r.limits.iter().all(fixed) || !r.overrides.values().flatten().all(fixed) {
                return Err(at(format!(
                    "rule {:?}: scope: global counts with algorithm: fixed_window (epoch-aligned windows only)",
                    r.name
                )));
            }
            if let Some(rc) = regions.filter(|rc| rc.mode == Mode::Budget) {
                // Every region's floor share must be at least one unit, or a region could be
                // left with nothing to spend and never earn a share.
                let floor = rc.floor_ppm();
                let all = r.limits.iter().chain(r.overrides.values().flatten());
                if let Some(q) = all.clone().find(|q| super::share_of(q.limit.get(), floor) == 0) {
                    return Err(at(format!(
                        "rule {:?}: limit {} is too small to split between {} regions in budget mode (each region's floor, budget_floor / regions, must be at least 1)",
                        r.name,
                        q.limit,
                        rc.peers.len() + 1
                    )));
                }
                if r.failure == crate::limiter::FailurePolicy::Open {
                    tracing::warn!(
                        rule = &*r.name,
                        "scope: global in budget mode with failure: open admits unchecked while this region's store fails: use failure: closed (or local) for a cap that must hold"
                    );
                }
            }
            if r.penalty.is_some() {
                return Err(at(format!(
                    "rule {:?}: scope: global does not take penalty (a penalty box is held in one region's store: the caller could serve it out in another)",
                    r.name
                )));
            }
            if r.settles_cost() || r.count_when.is_some() {
                return Err(at(format!(
                    "rule {:?}: scope: global does not take count_when or cost_from (a refund or debit after the answer is not replicated)",
                    r.name
                )));
            }
            Ok(true)
        })
        .collect()
}

impl std::fmt::Debug for PeerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerConfig")
            .field("name", &self.name)
            .field("cluster", &self.cluster)
            .field("urls", &self.urls.len())
            .finish_non_exhaustive()
    }
}
