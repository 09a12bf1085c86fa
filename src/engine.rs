//! The decision engine: request facts in, a [`Decision`] out, with no HTTP server around it.
//!
//! It identifies the caller, plans the request's limits ([`plan`]), asks the limiter, and
//! judges the verdict, in that order and nothing else: it counts no metric, writes no log line
//! and makes no response. The proxy, `/explain`, `/keys` and `tollgate explain` use it, and so
//! can any front end that has the facts of a request (method, path, host, headers, peer) but
//! no request to forward (ARCHITECTURE.md, "The request lifecycle").
//!
//! The facts are `http` types ([`http::Method`], [`http::Uri`], [`http::HeaderMap`]) and an IP
//! address: no hyper type, no body, no connection.

pub mod plan;

use std::time::{Duration, Instant};

pub use plan::{PlannedCheck, RequestParts as Facts, RequestPlan};

use crate::identity::{CredentialProblem, IdentityConfig};
use crate::limiter::keys::KeyBuilder;
use crate::limiter::{Limiter, PolicedCheck, Source, Verdict};
use crate::rules::runtime::RuntimeOverrides;
use crate::state::Snapshot;

/// What the engine decided for one request. The indices name checks of its
/// [`RequestPlan::checks`] (and outcomes of its [`Verdict`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Its credentials are refused: it is answered without checking any limit.
    Refused(CredentialProblem),
    /// No rule applies: it goes upstream unchecked.
    Unmatched,
    /// Every limit admits it. `binding` is the limit whose state its response advertises (the
    /// one nearest to denying); `None` when no checked limit can say (all shadow or unchecked).
    Admit {
        /// The advertised limit, if any.
        binding: Option<usize>,
    },
    /// A limit denies it; `binding` is the one whose wait is longest (the `Retry-After`).
    Limited {
        /// The denying limit.
        binding: usize,
    },
    /// The store could not answer for a rule that fails closed.
    Unavailable {
        /// The first such limit.
        check: usize,
    },
}

/// The limiter's answer for a planned request.
#[derive(Debug)]
pub struct Checked {
    /// One outcome per planned check.
    pub verdict: Verdict,
    /// The holder id its concurrency slots carry (0 when it takes none).
    pub holder: u64,
    /// How long it waited for the store; `None` when it was decided locally (deny cache,
    /// leases, memory store).
    pub store_wait: Option<Duration>,
}

/// Everything one decision reads but the runtime overrides (passed to [`Engine::plan`], so
/// their handle is not held across the store's wait): the rules and keys in force, the key
/// builder, the identity settings, and the limiter. Borrowed: an engine is made per request
/// from the gateway's current snapshot, for free.
#[derive(Clone, Copy)]
pub struct Engine<'a> {
    /// The rules and API keys in force.
    pub snap: &'a Snapshot,
    /// Builds the store keys.
    pub keys: &'a KeyBuilder,
    /// How callers are identified.
    pub identity: &'a IdentityConfig,
    /// Checks and spends quota.
    pub limiter: &'a Limiter,
    /// What the other regions spent of `scope: global` limits (`None`: one region).
    pub regions: Option<&'a crate::regions::Regions>,
}

impl Engine<'_> {
    /// Identify the caller and plan every limit `facts` must pass at `now_us`, with the limits
    /// set at run time in `runtime`. Pure: no I/O.
    pub fn plan(&self, runtime: &RuntimeOverrides, facts: Facts<'_>, now_us: u64) -> RequestPlan {
        plan::plan(
            plan::PlanContext {
                snap: self.snap,
                runtime,
                keys: self.keys,
                now_secs: now_us / 1_000_000,
            },
            self.identity,
            facts,
        )
    }

    /// Check and spend `plan`'s limits, all or nothing. Its concurrency checks get a holder
    /// id first (one per request). Waits only when the limiter must ask the store.
    pub async fn check(&self, plan: &mut RequestPlan, now_us: u64) -> Checked {
        let mut holder = 0;
        for c in plan.checks.iter_mut().filter(|c| c.check.is_slot()) {
            if holder == 0 {
                holder = self.limiter.holder();
            }
            c.check.holder = holder;
        }
        if let Some(v) = self.regional(plan, now_us) {
            return Checked {
                verdict: v,
                holder,
                store_wait: None,
            };
        }
        let (verdict, store_wait) = match self.limiter.begin(&plan.checks, now_us) {
            Ok(v) => (v, None),
            Err(ask) => {
                let started = Instant::now();
                let v = self.limiter.ask(&plan.checks, ask).await;
                (v, Some(started.elapsed()))
            }
        };
        Checked {
            verdict,
            holder,
            store_wait,
        }
    }

    /// Make each `scope: global` check of `plan` what this region may spend of it now
    /// ([`crate::regions::Regions::apply`]). `Some`: one has nothing left in this region, and
    /// the request is denied by it without asking the store (spending nothing anywhere).
    fn regional(&self, plan: &mut RequestPlan, now_us: u64) -> Option<Verdict> {
        let regions = self.regions?;
        let mut exhausted = None;
        for (i, c) in plan.checks.iter_mut().enumerate() {
            let global = self
                .snap
                .rules
                .rules
                .get(c.rule as usize)
                .is_some_and(|r| r.global_scope.is_some());
            // Only fixed windows add up across regions (a runtime override of another
            // algorithm counts in this region alone).
            let q = &c.check.quota;
            if !global || q.algorithm != crate::limiter::Algorithm::FixedWindow || q.calendar.is_some() {
                continue;
            }
            if let crate::regions::Applied::Exhausted { reset_us } = regions.apply(&mut c.check, now_us) {
                if !c.check.shadow && exhausted.is_none() {
                    exhausted = Some((i, reset_us));
                }
            }
        }
        let (at, reset_us) = exhausted?;
        let outcomes = plan
            .checks
            .iter()
            .enumerate()
            .map(|(i, _)| {
                let o = if i == at {
                    crate::limiter::Outcome {
                        allowed: false,
                        reset_us,
                        retry_after_us: reset_us,
                        at_us: now_us,
                        ..Default::default()
                    }
                } else {
                    crate::limiter::Outcome {
                        allowed: true,
                        ..Default::default()
                    }
                };
                (o, Source::Store)
            })
            .collect();
        Some(Verdict {
            outcomes,
            store_error: None,
        })
    }

    /// What `verdict` means for `plan`. Pure.
    ///
    /// A fail-closed rule whose store was down wins over everything. Otherwise the binding
    /// limit: shadow limits never bind, nor do limits that went unchecked (store down, fail
    /// open: their quota is unknown, and `r=0` would stall a header-following client); a
    /// `cost_from` rule's in-flight cap binds only when it denies.
    pub fn judge(&self, plan: &RequestPlan, verdict: &Verdict) -> Decision {
        if let Some(p) = plan.refused {
            return Decision::Refused(p);
        }
        if plan.checks.is_empty() {
            return Decision::Unmatched;
        }
        let pairs = || plan.with_outcomes(verdict);
        if let Some(check) = pairs().position(|(c, (_, s))| !c.check.shadow && *s == Source::FailClosed) {
            return Decision::Unavailable { check };
        }
        let binding = crate::http::headers::binding_index(pairs().map(|(c, (o, src))| {
            let skip =
                c.check.shadow || *src == Source::FailOpen || (o.allowed && plan::is_in_flight_cap(self.snap, c));
            (skip, *o, c.check.cost)
        }));
        match binding {
            Some(i) if !verdict.outcomes[i].0.allowed => Decision::Limited { binding: i },
            binding => Decision::Admit { binding },
        }
    }

    /// [`Engine::plan`], [`Engine::check`] and [`Engine::judge`] in one: for a front end that
    /// needs the decision and nothing else. A refused or unmatched request spends nothing.
    pub async fn decide(
        &self,
        runtime: &RuntimeOverrides,
        facts: Facts<'_>,
        now_us: u64,
    ) -> (RequestPlan, Checked, Decision) {
        let mut plan = self.plan(runtime, facts, now_us);
        let checked = if plan.refused.is_some() || plan.checks.is_empty() {
            Checked {
                verdict: Verdict::default(),
                holder: 0,
                store_wait: None,
            }
        } else {
            self.check(&mut plan, now_us).await
        };
        let decision = self.judge(&plan, &checked.verdict);
        (plan, checked, decision)
    }
}

/// Check and spend `checks` at `now_us` (the limiter's clock), all or nothing, for a front end
/// whose limits do not come from the rules file (the Envoy rate-limit service's descriptors):
/// the limiter's verdict and how long the store was waited for (`None`: decided locally). No
/// concurrency slots: the checks hold none.
pub async fn check_limits<P: PolicedCheck>(
    limiter: &Limiter,
    checks: &[P],
    now_us: u64,
) -> (Verdict, Option<Duration>) {
    match limiter.begin(checks, now_us) {
        Ok(v) => (v, None),
        Err(ask) => {
            let started = Instant::now();
            let v = limiter.ask(checks, ask).await;
            (v, Some(started.elapsed()))
        }
    }
}

#[cfg(test)]
mod tests;
