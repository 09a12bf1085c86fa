//! Metrics and logs for one verdict: one count per rule, the denial and penalty log lines, the
//! dashboard's most-limited list.

use std::sync::atomic::Ordering;

use crate::identity::Identity;
use crate::limiter::{Source, StoreError, Verdict};
use crate::rules::caller;
use crate::state::State;

use crate::engine::plan::RequestPlan;

impl State {
    /// Metrics and logs for one verdict.
    pub(super) fn account(
        &self,
        snap: &crate::state::Snapshot,
        plan: &RequestPlan,
        verdict: &Verdict,
        ident: &Identity,
    ) {
        if let Some(e) = &verdict.store_error {
            match e {
                StoreError::Timeout => self.metrics().store.timeout.inc(),
                StoreError::CircuitOpen => self.metrics().store.circuit_open.inc(),
                _ => self.metrics().store.error.inc(),
            };
        }
        let mut last_rule = u32::MAX;
        for (p, (o, src)) in plan.with_outcomes(verdict) {
            let (c, ri) = (&p.check, &p.rule);
            // One count per rule: its first denying limit, else its first limit.
            let first_of_rule = *ri != last_rule;
            last_rule = *ri;
            let m = &snap.rule_metrics[*ri as usize];
            let rule = &snap.rules.rules[*ri as usize];
            if *src == Source::DenyCache && !o.allowed {
                self.metrics().store.deny_cache_hits.inc();
            }
            if o.penalty_started {
                m.penalty_started.inc();
                tracing::info!(rule = %rule.name, identity_kind = ident.kind.as_str(), identity = %caller(ident).tag(self.keys(), ""), penalty_ms = o.penalty_us / 1000, "penalty box: key blocked");
            }
            if !first_of_rule && o.allowed {
                continue;
            }
            match (src, o.allowed, c.shadow) {
                (Source::FailOpen, _, _) => m.fail_open.inc(),
                (Source::FailClosed, _, _) => m.fail_closed.inc(),
                (Source::Local, true, _) => m.local.inc(),
                (_, true, _) => m.allowed.inc(),
                (_, false, true) => {
                    let n = self.shadow_seen().fetch_add(1, Ordering::Relaxed);
                    if n % self.config().limits.shadow_log_sample == 0 {
                        tracing::info!(rule = %rule.name, identity_kind = ident.kind.as_str(), identity = %caller(ident).tag(self.keys(), ""), retry_after_ms = o.retry_after_us / 1000, sampled_one_in = self.config().limits.shadow_log_sample, "shadow rule would deny");
                    }
                    m.would_deny.inc()
                }
                (_, false, false) => {
                    if *src != Source::DenyCache {
                        // DEBUG: a flood of denials is counted (`tollgate_requests_total`), not
                        // logged line by line at INFO.
                        tracing::debug!(rule = %rule.name, identity_kind = ident.kind.as_str(), identity = %caller(ident).tag(self.keys(), ""), retry_after_ms = o.retry_after_us / 1000, "denied");
                    }
                    if matches!(src, Source::Local) {
                        m.local.inc();
                    }
                    // The dashboard's "most limited": the hash already in the counter's key.
                    if let Some(kind) = crate::activity::limited_kind(&rule.key) {
                        self.activity().denied(c.key.hash_tag(), &rule.name, kind);
                    }
                    m.denied.inc()
                }
            };
        }
    }
}
