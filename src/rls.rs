//! The Envoy rate-limit service front end (`envoy.service.ratelimit.v3.RateLimitService`):
//! envoyproxy/ratelimit's API and config files, decided by tollgate's limiter (the same
//! stores, leases, breakers and failure policies as the proxy), all or nothing per request
//! (ARCHITECTURE.md, "The Envoy rate-limit service").
//!
//! | file | what it does |
//! |---|---|
//! | `config` | the config directory's domain files, compiled into descriptor trees |
//! | `matcher` | a request descriptor → the configured entry it matches |
//! | `decide` | one `ShouldRateLimit`: validate, match, plan the checks, answer |
//! | `serve` | the listener: gRPC (with `grpc.health.v1`), `/json`, `/healthcheck`; drain |
//!
//! Metrics are per domain (bounded by the config, never by request values): calls, and
//! descriptors answered OK, over the limit, unlimited, or matching no limit.

pub mod config;
pub mod decide;
pub mod json;
pub mod matcher;
pub mod serve;

use std::path::PathBuf;
use std::sync::Arc;

use arc_swap::ArcSwap;

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};

use crate::config::rls::RlsSettings;
use crate::metrics::RlsLabels;
use crate::state::State;
use crate::yaml::ConfigError;
use config::Domains;

/// The front end's shared state: the gateway's (limiter, key builder, clock) and the domains
/// in force.
pub struct Rls {
    gw: Arc<State>,
    settings: RlsSettings,
    domains: ArcSwap<Domains>,
}

impl Rls {
    /// Load the config directory of `settings` (refused: the error, `file:line:col`).
    pub fn new(gw: Arc<State>, settings: RlsSettings) -> Result<Arc<Self>, ConfigError> {
        let domains = config::load_dir(&settings.config_dir, settings.failure)?;
        gw.metrics().rls.set_domains(summary(&domains));
        Ok(Arc::new(Rls {
            gw,
            settings,
            domains: ArcSwap::from_pointee(domains),
        }))
    }

    /// The gateway state the decisions use.
    pub fn gateway(&self) -> &Arc<State> {
        &self.gw
    }

    /// The settings.
    pub fn settings(&self) -> &RlsSettings {
        &self.settings
    }

    /// The domains in force.
    pub fn domains(&self) -> arc_swap::Guard<Arc<Domains>> {
        self.domains.load()
    }

    /// The metrics.
    pub fn metrics(&self) -> &crate::metrics::RlsMetrics {
        &self.gw.metrics().rls
    }

    /// Answer one `ShouldRateLimit` call, counting it in the per-domain metrics.
    pub async fn should_rate_limit(&self, req: &RateLimitRequest) -> Result<RateLimitResponse, decide::Refusal> {
        let domains = self.domains.load_full();
        let domain = if domains.by_name.contains_key(&req.domain) {
            req.domain.as_str()
        } else {
            "unknown"
        };
        let m = self.metrics();
        let count = |family: &prometheus_client::metrics::family::Family<
            RlsLabels,
            prometheus_client::metrics::counter::Counter,
        >,
                     outcome: &'static str,
                     n: u64| {
            if n > 0 {
                family
                    .get_or_create(&RlsLabels {
                        domain: domain.to_string(),
                        outcome,
                    })
                    .inc_by(n);
            }
        };
        let plan = match decide::plan(&domains, self.gw.keys(), req) {
            Ok(p) => p,
            Err(e) => {
                count(&m.calls, "invalid", 1);
                return Err(e);
            }
        };
        let now = self.gw.clock().now_us();
        let (resp, verdict) = plan.run(self.gw.limiter(), now, self.settings.headers).await;
        for (name, st) in plan.metric_names().zip(&resp.statuses) {
            if let Some((name, configured)) = name {
                let over = st.code == Code::OverLimit as i32;
                m.limit_answered(domain, (name, configured), name != configured, over);
            }
        }
        if let Some(e) = &verdict.store_error {
            tracing::debug!(error = %e, domain, "rls: the store could not answer; failure policies applied");
        }
        let over = resp.overall_code == Code::OverLimit as i32;
        count(&m.calls, if over { "over_limit" } else { "ok" }, 1);
        let (mut ok, mut limited, mut unlimited, mut none) = (0, 0, 0, 0);
        for s in &resp.statuses {
            match (s.code == Code::OverLimit as i32, &s.current_limit) {
                (true, _) => limited += 1,
                (false, Some(_)) => ok += 1,
                (false, None) if s.limit_remaining == u32::MAX => unlimited += 1,
                (false, None) => none += 1,
            }
        }
        count(&m.descriptors, "ok", ok);
        count(&m.descriptors, "over_limit", limited);
        count(&m.descriptors, "unlimited", unlimited);
        count(&m.descriptors, "no_limit", none);
        Ok(resp)
    }

    /// Re-read the config directory. A file that does not compile keeps the config in force
    /// (logged, counted) and is returned.
    pub fn reload(&self) -> Result<usize, ConfigError> {
        match config::load_dir(&self.settings.config_dir, self.settings.failure) {
            Ok(d) => {
                let n = d.by_name.len();
                tracing::info!(domains = n, dir = %self.settings.config_dir.display(), "rls config reloaded");
                self.metrics().set_domains(summary(&d));
                self.domains.store(Arc::new(d));
                self.metrics().reloads.inc();
                Ok(n)
            }
            Err(e) => {
                self.metrics().reload_errors.inc();
                tracing::error!(error = %e, "rls config reload refused; the previous config stays in force");
                Err(e)
            }
        }
    }

    /// What the config directory looks like now: every `*.yaml` file's name, size, mtime and
    /// inode, and where the directory resolves to (a swapped `RUNTIME_ROOT` symlink). A change
    /// is a reload.
    pub fn fingerprint(&self) -> Vec<(PathBuf, u64, Option<std::time::SystemTime>, u64)> {
        fingerprint(&self.settings.config_dir)
    }
}

/// See [`Rls::fingerprint`].
pub fn fingerprint(dir: &std::path::Path) -> Vec<(PathBuf, u64, Option<std::time::SystemTime>, u64)> {
    let mut out = Vec::new();
    if let Ok(real) = std::fs::canonicalize(dir) {
        out.push((real, 0, None, 0));
    }
    for f in config::files_of(dir).unwrap_or_default() {
        let m = std::fs::metadata(&f).ok();
        #[cfg(unix)]
        let ino = m.as_ref().map_or(0, std::os::unix::fs::MetadataExt::ino);
        #[cfg(not(unix))]
        let ino = 0;
        out.push((
            f,
            m.as_ref().map_or(0, std::fs::Metadata::len),
            m.and_then(|m| m.modified().ok()),
            ino,
        ));
    }
    out
}

#[cfg(test)]
mod tests;

/// The domains in force for the dashboard: each name, its file and its entries with a limit,
/// by name.
fn summary(d: &Domains) -> Vec<crate::metrics::RlsDomain> {
    let mut v: Vec<_> = d
        .by_name
        .values()
        .map(|d| crate::metrics::RlsDomain {
            name: d.name.clone(),
            file: d
                .file
                .file_name()
                .map(|f| f.to_string_lossy().into_owned())
                .unwrap_or_default(),
            limits: d.limits,
        })
        .collect();
    v.sort_by(|a, b| a.name.cmp(&b.name));
    v
}
