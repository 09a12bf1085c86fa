//! The reload family: loads of the rules and keys, what they changed, the rule-set version, the
//! gateway file on disk, and the listener certificate.

use std::time::SystemTime;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use super::{gauge, ResultLabels};

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ChangeLabels {
    file: &'static str,
    change: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct VersionLabels {
    version: String,
}

/// The reload metrics; every handle is registered once, in [`Reload::register`].
pub struct Reload {
    /// Reloads that succeeded.
    pub ok: Counter,
    /// Reloads refused.
    pub error: Counter,
    /// 1 when the last reload succeeded (and at start), 0 after a refused one.
    pub last_success: Gauge,
    /// Unix time of the last successful load (start or reload).
    pub last_success_timestamp: Gauge,
    /// `tollgate_reload_changes_total{file,change}`.
    changes: Family<ChangeLabels, Counter>,
    /// 1 while gateway.yaml on disk differs from the one this process started with.
    pub config_file_changed: Gauge,
    /// `tollgate_rules_info{version}`.
    rules_info: Family<VersionLabels, Gauge>,
}

impl Reload {
    /// Register the family in `r`.
    pub(super) fn register(r: &mut Registry) -> Self {
        let reloads = Family::<ResultLabels, Counter>::default();
        r.register("reloads", "Rule/key reloads by result", reloads.clone());
        let ok = reloads.get_or_create(&ResultLabels { result: "ok".into() }).clone();
        let error = reloads.get_or_create(&ResultLabels { result: "error".into() }).clone();
        let last_success = gauge(
            r,
            "last_reload_success",
            "1 if the last load of the rules and keys (start or reload) succeeded, 0 if it was refused",
        );
        let last_success_timestamp = gauge(
            r,
            "last_reload_success_timestamp_seconds",
            "Unix time of the last successful load of the rules and keys",
        );
        let changes = Family::<ChangeLabels, Counter>::default();
        r.register(
            "reload_changes",
            "Rules and API keys added, removed or changed by reloads",
            changes.clone(),
        );
        let config_file_changed = gauge(
            r,
            "config_file_changed",
            "1 while the gateway config file differs from the one running (restart to apply it)",
        );
        let rules_info = Family::<VersionLabels, Gauge>::default();
        r.register(
            "rules_info",
            "The loaded rule-set version (value 1)",
            rules_info.clone(),
        );
        Reload {
            ok,
            error,
            last_success,
            last_success_timestamp,
            changes,
            config_file_changed,
            rules_info,
        }
    }

    /// Record the loaded rule-set version.
    pub fn set_rules_version(&self, version: &str) {
        self.rules_info.clear();
        self.rules_info
            .get_or_create(&VersionLabels {
                version: version.to_string(),
            })
            .set(1);
    }

    /// Count what one reload changed in `file` (`rules` or `keys`).
    pub fn changed(&self, file: &'static str, added: u64, removed: u64, changed: u64) {
        for (change, n) in [("added", added), ("removed", removed), ("changed", changed)] {
            if n > 0 {
                self.changes.get_or_create(&ChangeLabels { file, change }).inc_by(n);
            }
        }
    }

    /// Record a successful load (start or reload) at unix time `now`.
    pub fn succeeded(&self, now: SystemTime) {
        self.last_success.set(1);
        let secs = now.duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        self.last_success_timestamp.set(i64::try_from(secs).unwrap_or(i64::MAX));
    }
}

/// The listener certificate's metrics; registered once, in [`Tls::register`].
pub struct Tls {
    /// The listener certificate's `notAfter`, unix seconds (0 without TLS):
    /// `tollgate_tls_certificate_expiry_timestamp_seconds`.
    pub cert_expiry: Gauge,
    /// Listener certificate reloads that took effect.
    pub reload_ok: Counter,
    /// Listener certificate reloads refused (the old certificate kept serving).
    pub reload_error: Counter,
}

impl Tls {
    /// Register the family in `r`.
    pub(super) fn register(r: &mut Registry) -> Self {
        let reloads = Family::<ResultLabels, Counter>::default();
        r.register(
            "tls_certificate_reloads",
            "Listener certificate reloads by result (error: the old certificate kept serving)",
            reloads.clone(),
        );
        let reload_ok = reloads.get_or_create(&ResultLabels { result: "ok".into() }).clone();
        let reload_error = reloads.get_or_create(&ResultLabels { result: "error".into() }).clone();
        let cert_expiry = gauge(
            r,
            "tls_certificate_expiry_timestamp_seconds",
            "When the listener certificate now served expires (its notAfter), unix seconds; alert well before it",
        );
        Tls {
            cert_expiry,
            reload_ok,
            reload_error,
        }
    }
}
