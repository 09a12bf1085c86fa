//! The reload: rules, API keys and JWT keys read, validated and compiled off the request
//! threads, compared with what is in force, and swapped in whole (or refused whole, the old
//! ones staying in force); what it changed, for the admin API, the metrics and the dashboard.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::SystemTime;

use crate::activity::Changes;
use crate::config::reload::Trigger;
use crate::config::ConfigError;
use crate::rules::runtime::RuntimeOverrides;
use crate::rules::RuleSet;

use super::{load_snapshot, unix_secs, State};

/// What one successful reload changed.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ReloadReport {
    /// The rules version now in force.
    pub version: String,
    /// Did anything change (rules or keys)?
    pub changed: bool,
    /// Rules added, removed, changed (by name).
    pub rules: Changes,
    /// API keys added, removed, changed (by key hash).
    pub keys: Changes,
    /// The names of the rules added, removed and changed.
    pub rule_names: Named,
}

/// The names of the entries added, removed and changed, in name order.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Named {
    /// New entries.
    pub added: Vec<String>,
    /// Entries gone.
    pub removed: Vec<String>,
    /// Entries present before and after, but different.
    pub changed: Vec<String>,
}

impl Named {
    /// Compare two maps of name → comparable value.
    fn between<V: PartialEq>(old: &BTreeMap<String, V>, new: &BTreeMap<String, V>) -> Self {
        let mut n = Named::default();
        for (k, v) in new {
            match old.get(k) {
                None => n.added.push(k.clone()),
                Some(o) if o != v => n.changed.push(k.clone()),
                Some(_) => {}
            }
        }
        n.removed = old.keys().filter(|k| !new.contains_key(*k)).cloned().collect();
        n
    }
}

/// Each rule's name → everything that decides its behaviour, as comparable text.
fn rule_signatures(rules: &RuleSet) -> BTreeMap<String, String> {
    rules
        .rules
        .iter()
        .map(|r| {
            let overrides: BTreeMap<&String, String> = r.overrides.iter().map(|(k, v)| (k, format!("{v:?}"))).collect();
            let sig = format!(
                "{}|{:?}|{:?}|{:?}|{overrides:?}",
                crate::describe::rule(r),
                r.limits,
                r.headers,
                r.host
            );
            (r.name.to_string(), sig)
        })
        .collect()
}

impl State {
    /// Reload rules, API keys and JWT keys. On error the old ones all stay in force. Also notices (warning
    /// and `tollgate_config_file_changed`) when the gateway config file itself was edited: its
    /// settings (listeners, store, identity) need a restart.
    pub async fn reload(&self, why: Trigger) -> Result<ReloadReport, ConfigError> {
        let why = why.as_str();
        let _guard = self.reload_lock.lock().await;
        self.check_config_file();
        // Parse, validate, compile and compare on a low-priority thread: a large registry takes
        // seconds, and the runtime's workers serve requests meanwhile (`background`). The JWT keys (public key
        // / JWKS files) reload with the rules: all or nothing.
        let (config, metrics, old) = (self.config.clone(), self.metrics.clone(), self.snapshot.load_full());
        let rules_file = self.config.rules_file.clone();
        let loaded = crate::background::run("reload", move || {
            let snap = load_snapshot(&config, &metrics)?;
            let jwt = match &config.identity.jwt {
                Some(k) => Some(k.prepare()?),
                None => None,
            };
            let (old_sigs, new_sigs) = (rule_signatures(&old.rules), rule_signatures(&snap.rules));
            let rules = Changes::between(&old_sigs, &new_sigs);
            let rule_names = Named::between(&old_sigs, &new_sigs);
            let (added, removed, changed) = snap.keys.diff(&old.keys);
            let keys = Changes {
                added,
                removed,
                changed,
            };
            let changed = rules.any() || keys.any() || old.rules.version != snap.rules.version;
            let old_rules: Vec<String> = old.rules.rules.iter().map(|r| r.name.to_string()).collect();
            Ok((snap, jwt, (rules, rule_names), keys, changed, old_rules))
        })
        .await
        .unwrap_or_else(|e| Err(ConfigError::file(&rules_file, e.to_string())));
        match loaded {
            Ok((snap, jwt, (rules, rule_names), keys, changed, old_rules)) => {
                if let (Some(keys), Some(v)) = (&self.config.identity.jwt, jwt) {
                    keys.install(v);
                }
                let version = snap.rules.version.clone();
                self.metrics.reload.set_rules_version(&version);
                self.metrics.reload.succeeded(snap.loaded_at);
                self.metrics
                    .reload
                    .changed("rules", rules.added, rules.removed, rules.changed);
                self.metrics
                    .reload
                    .changed("keys", keys.added, keys.removed, keys.changed);
                if rules.removed > 0 {
                    // Drop the series of rules that no longer exist.
                    let now: std::collections::HashSet<&str> = snap.rules.rules.iter().map(|r| &*r.name).collect();
                    for r in old_rules.iter().filter(|r| !now.contains(r.as_str())) {
                        self.metrics.traffic.forget_rule(r);
                    }
                }
                // Runtime overrides survive the reload: recompiled against the new rules.
                let stored = self.runtime.load().stored.clone();
                self.runtime
                    .store(Arc::new(RuntimeOverrides::compile(stored, &snap.rules)));
                let previous = self.snapshot.swap(Arc::new(snap));
                // Freeing a large snapshot takes a while too: not on a request thread, and not
                // by a request that happened to hold the last reference.
                crate::background::reclaim(previous);
                if let Some(d) = self.limiter.deny_cache() {
                    // Limits may have changed: cached denials may no longer be true.
                    d.clear();
                }
                // Leases were taken under the old limits: give them back.
                self.limiter.return_leases(true).await;
                self.metrics.reload.ok.inc();
                self.activity.reloaded(crate::activity::ReloadEvent {
                    at: unix_secs(SystemTime::now()),
                    trigger: why,
                    ok: true,
                    version: version.clone(),
                    changed,
                    rules: Some(rules),
                    keys: Some(keys),
                    error: None,
                });
                tracing::info!(
                    trigger = why,
                    version = %version,
                    changed,
                    rules_added = rules.added,
                    rules_removed = rules.removed,
                    rules_changed = rules.changed,
                    keys_added = keys.added,
                    keys_removed = keys.removed,
                    keys_changed = keys.changed,
                    added = %rule_names.added.join(","),
                    removed = %rule_names.removed.join(","),
                    changed_rules = %rule_names.changed.join(","),
                    "rules and keys reloaded"
                );
                Ok(ReloadReport {
                    version,
                    changed,
                    rules,
                    keys,
                    rule_names,
                })
            }
            Err(e) => {
                self.metrics.reload.error.inc();
                self.metrics.reload.last_success.set(0);
                self.activity.reloaded(crate::activity::ReloadEvent {
                    at: unix_secs(SystemTime::now()),
                    trigger: why,
                    ok: false,
                    version: self.snapshot.load().rules.version.clone(),
                    changed: false,
                    rules: None,
                    keys: None,
                    error: Some(e.to_string()),
                });
                tracing::error!(trigger = why, error = %e, "reload refused; previous rules stay in force");
                Err(e)
            }
        }
    }
}
