//! One request's plan: who the caller is and every limit it must pass, built in this one place
//! for the proxy, `/explain`, `/keys` and `tollgate explain` alike, so they can never disagree
//! about the keys a request uses.
//!
//! Pure: no I/O. Identity and matching read borrowed request data; one tag (a SHA-256) is
//! computed per distinct key value, and a `global` rule's keys were built when the rules loaded.

use std::net::IpAddr;

use http::{header, HeaderMap, Method, Uri};

use crate::identity::IdentityConfig;
use crate::identity::{identify_checked, CredentialProblem, Identity, IdentityKind};
use crate::limiter::keys::KeyBuilder;
use crate::limiter::{local_share, FailurePolicy, LimitCheck, Outcome, PolicedCheck, Source, Verdict};
use crate::rules::runtime::RuntimeOverrides;
use crate::rules::{key_value, method_override, normalize, KeyValue, RequestInfo};
use crate::state::Snapshot;

/// One limit of the plan: what to check, what happens when the store cannot answer for it,
/// and the rule it came from.
#[derive(Debug, Clone)]
pub struct PlannedCheck {
    /// The limit: key, quota, cost, shadow.
    pub check: LimitCheck,
    /// The rule's failure policy.
    pub policy: FailurePolicy,
    /// Index of the rule in the snapshot's rule set.
    pub rule: u32,
    /// Where the limits came from.
    pub from: LimitsFrom,
    /// This limit may be decided from a lease (its rule allows it and its algorithm takes them).
    pub leasable: bool,
    /// Which of its rule's spends it reserves for ([`crate::rules::SpendRef::slot`]): checks of
    /// one rule and slot settle against one reported cost.
    pub spend: u8,
}

/// Where a planned check's limits came from, for `/explain`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LimitsFrom {
    /// The rule's own limits.
    Rule,
    /// The rule's override for this identity in the rules file.
    FileOverride,
    /// A runtime override (admin API), which beats the file; it applies until this instant
    /// (microseconds since the epoch).
    Runtime {
        /// Expiry.
        expires_at_us: u64,
    },
}

impl AsRef<LimitCheck> for PlannedCheck {
    fn as_ref(&self) -> &LimitCheck {
        &self.check
    }
}

impl PolicedCheck for PlannedCheck {
    fn policy(&self) -> FailurePolicy {
        self.policy
    }

    fn leasable(&self) -> bool {
        self.leasable
    }
}

/// Everything one request is checked against.
#[derive(Debug, Clone)]
pub struct RequestPlan {
    /// The caller.
    pub identity: Identity,
    /// The chosen rule of each key kind, each with all its limits (its override's, when the
    /// caller has one), rule after rule. Empty when no rule matched, and when `refused`.
    pub checks: PlannedChecks,
    /// The request's credentials are refused: it is answered with this, checked against no
    /// limit and never forwarded.
    pub refused: Option<CredentialProblem>,
}

impl PlannedCheck {
    /// The limit as it was enforced from `source`: this node's share of it when the rule's
    /// local fallback decided (`failure: local` while the store was down), else the limit
    /// itself.
    pub fn enforced(&self, source: Source) -> std::borrow::Cow<'_, LimitCheck> {
        match (source, self.policy) {
            (Source::Local, FailurePolicy::Local { share }) => std::borrow::Cow::Owned(local_share(&self.check, share)),
            _ => std::borrow::Cow::Borrowed(&self.check),
        }
    }
}

impl RequestPlan {
    /// Each planned check with its outcome in `verdict` (one per check, in order).
    pub fn with_outcomes<'a>(
        &'a self,
        verdict: &'a Verdict,
    ) -> impl Iterator<Item = (&'a PlannedCheck, &'a (Outcome, Source))> + 'a {
        self.checks.iter().zip(&verdict.outcomes)
    }
}

/// A request's planned checks, inline up to two (no allocation for the usual one or two
/// limits).
pub type PlannedChecks = smallvec::SmallVec<[PlannedCheck; 2]>;

/// The parts of a request a plan reads.
#[derive(Debug, Clone, Copy)]
pub struct RequestParts<'a> {
    /// The request method, as sent.
    pub method: &'a Method,
    /// Request target; only the path is matched (the query never is).
    pub uri: &'a Uri,
    /// Headers (identity, host, header conditions and `header:` keys).
    pub headers: &'a HeaderMap,
    /// The connection's peer address.
    pub peer: IpAddr,
}

/// Build the plan of `req` against `cx` (the rules and runtime overrides in force, the key
/// builder, now) with `identity`'s settings.
pub fn plan(cx: PlanContext<'_>, identity: &IdentityConfig, req: RequestParts<'_>) -> RequestPlan {
    let (snap, now_secs) = (cx.snap, cx.now_secs);
    let (ident, refused) = identify_checked(req.headers, req.peer, &snap.keys, identity, now_secs);
    if refused.is_some() {
        return RequestPlan {
            identity: ident,
            checks: PlannedChecks::new(),
            refused,
        };
    }
    let path = normalize(req.uri.path());
    let overridden = if snap.rules.uses_method_override {
        method_override(req.headers)
    } else {
        None
    };
    let info = RequestInfo {
        method: req.method,
        method_override: overridden.as_ref(),
        path: &path,
        // Only rules with a `host` condition read it.
        host: if snap.rules.uses_host {
            request_host(req.headers, req.uri)
        } else {
            None
        },
        headers: req.headers,
        tier: &ident.tier,
    };
    let selected = snap.rules.select(&info);
    let mut checks = PlannedChecks::new();
    if !selected.is_empty() {
        // The client address as text, for `ip` rules (inline: no allocation).
        let ip_text = if ident.kind == IdentityKind::Ip {
            ident.id.clone()
        } else {
            crate::identity::ip_text(ident.ip)
        };
        let mut acc = Planned::default();
        for ri in selected {
            if let crate::rules::KeyKind::Header(h) = &snap.rules.rules[ri as usize].key {
                // A key header must be one field with one value: which of several the upstream
                // reads is unknown, so none is believed (as with credentials).
                let mut fields = req.headers.get_all(h).iter();
                let first = fields.next();
                if fields.next().is_some() || first.is_some_and(|v| v.as_bytes().contains(&b',')) {
                    return RequestPlan {
                        identity: ident,
                        checks: PlannedChecks::new(),
                        refused: Some(CredentialProblem::Ambiguous(
                            "a header a rule is keyed by is sent twice or as a list",
                        )),
                    };
                }
            }
            if let Some(value) = key_value(
                &snap.rules.rules[ri as usize].key,
                &ident,
                req.headers,
                ip_text.as_bytes(),
            ) {
                rule_checks(cx, ri, value, &ident.id, &mut acc);
            }
        }
        checks = acc.checks;
    }
    RequestPlan {
        identity: ident,
        checks,
        refused: None,
    }
}

/// What planning reads besides the request: the rules in force, the runtime overrides, the key
/// builder, and now (unix seconds).
#[derive(Clone, Copy)]
pub struct PlanContext<'a> {
    /// The rules and keys in force.
    pub snap: &'a Snapshot,
    /// The runtime overrides in force.
    pub runtime: &'a RuntimeOverrides,
    /// Builds store keys.
    pub keys: &'a KeyBuilder,
    /// Now, unix seconds.
    pub now_secs: u64,
}

/// The checks planned so far, and the last key value with its tag (a caller's rules hash its
/// value once).
#[derive(Default)]
pub struct Planned<'v> {
    /// The previous value and its tag.
    pub last: Option<(KeyValue<'v>, crate::limiter::keys::Tag)>,
    /// The checks, rule after rule.
    pub checks: PlannedChecks,
}

/// Append the checks of rule `ri` for the key value `value`: the limits of a runtime override
/// for that value when one is in force, else of `who`'s override in the rules file, else the
/// rule's. `last` remembers the previous value's tag, so a caller's rules hash its value once.
pub fn rule_checks<'v>(
    cx: PlanContext<'_>,
    ri: u32,
    value: KeyValue<'v>,
    who: &crate::identity::IdText,
    acc: &mut Planned<'v>,
) {
    let PlanContext {
        snap,
        runtime,
        keys,
        now_secs,
    } = cx;
    let Planned { last, checks: out } = acc;
    let rule = &snap.rules.rules[ri as usize];
    let planned = |(check, spend): (LimitCheck, u8), from: LimitsFrom| PlannedCheck {
        leasable: rule.lease && crate::limiter::lease::algorithm_leases(check.quota.algorithm),
        check,
        policy: rule.failure,
        rule: ri,
        from,
        spend,
    };
    // Limit `n` spends as the rule says, or in its own way (`limits: [{…, cost: …}]`).
    let check = |key, q: &crate::limiter::Quota, n: usize| {
        let spend = rule.spend(n);
        let c = LimitCheck {
            key,
            quota: *q,
            cost: spend.cost,
            shadow: rule.shadow,
            holder: 0,
            penalty: rule.penalty,
            lease: None,
        };
        (c, spend.slot)
    };
    let first = out.len();
    let file_limits = || {
        let limits = rule.limits_for_id(who);
        let from = if std::ptr::eq(limits, rule.limits.as_slice()) {
            LimitsFrom::Rule
        } else {
            LimitsFrom::FileOverride
        };
        (limits, from)
    };
    if let (KeyValue::Global, Some(fixed)) = (value, snap.global_keys.get(ri as usize)) {
        // Global counters have fixed keys, built when the rules loaded.
        let (limits, from) = file_limits();
        if fixed.len() >= limits.len() {
            out.extend(
                limits
                    .iter()
                    .zip(fixed)
                    .enumerate()
                    .map(|(n, (q, key))| planned(check(key.clone(), q, n), from)),
            );
            if let Some(c) = out.get(first).and_then(|p| in_flight_check(rule, &p.check)) {
                out.push(planned((c, crate::rules::RULE_SPEND), from));
            }
            return;
        }
    }
    let tag = match last {
        Some((v, t)) if *v == value && value != KeyValue::Global => *t,
        _ => {
            let t = value.tag(keys, &rule.name);
            *last = Some((value, t));
            t
        }
    };
    let runtime_limits = if runtime.is_empty() || value == KeyValue::Global {
        None
    } else {
        runtime.get(&tag, &rule.name, now_secs.saturating_mul(1_000_000))
    };
    let (limits, from) = match runtime_limits {
        Some(a) => (
            a.quotas.as_slice(),
            LimitsFrom::Runtime {
                expires_at_us: a.expires_at_us,
            },
        ),
        None => file_limits(),
    };
    out.extend(
        limits
            .iter()
            .enumerate()
            .map(|(n, q)| planned(check(keys.key(&tag, &rule.key_name, n), q, n), from)),
    );
    if let Some(c) = out.get(first).and_then(|p| in_flight_check(rule, &p.check)) {
        out.push(planned((c, crate::rules::RULE_SPEND), from));
    }
}

/// A `cost_from` rule's cap on its requests in flight per key (`cost_from.in_flight`): one
/// concurrency slot per request, at the key of the rule's first limit with `:f` appended (the
/// same hash tag, so the same store call, all or nothing with the rule's limits). It bounds
/// what a key can spend before its requests settle to `in_flight × (max − cost)`.
fn in_flight_check(rule: &crate::rules::Rule, first: &LimitCheck) -> Option<LimitCheck> {
    let quota = rule.in_flight_cap()?;
    let mut key = String::with_capacity(first.key.as_str().len() + 2);
    key.push_str(first.key.as_str());
    key.push_str(":f");
    Some(LimitCheck {
        key: key.into(),
        quota,
        cost: 1,
        shadow: rule.shadow,
        holder: 0,
        penalty: None,
        lease: None,
    })
}

/// True for the in-flight cap of a `cost_from` rule (see [`in_flight_check`]): a slot of a
/// rule that is not itself a concurrency rule. It binds a response's headers only when it denies.
pub fn is_in_flight_cap(snap: &Snapshot, p: &PlannedCheck) -> bool {
    p.check.is_slot() && snap.rules.rules.get(p.rule as usize).is_some_and(|r| r.settles_cost())
}

/// Host without port: the target's authority when it has one (HTTP/2 `:authority`,
/// absolute-form; RFC 9112 §3.2.2, RFC 9113 §8.3.1), else `Host`.
pub fn request_host<'a>(headers: &'a HeaderMap, uri: &'a Uri) -> Option<&'a str> {
    if let Some(h) = uri.host() {
        return Some(host_for_matching(h));
    }
    Some(host_for_matching(headers.get(header::HOST)?.to_str().ok()?))
}

/// A `Host` value as rules match it: without the port, and without a trailing dot
/// (`api.example.` is `api.example`: one name, one rule).
pub fn host_for_matching(raw: &str) -> &str {
    let host = match raw.rfind(':') {
        Some(i) if !raw.ends_with(']') && raw[i + 1..].bytes().all(|b| b.is_ascii_digit()) => &raw[..i],
        _ => raw,
    };
    host.strip_suffix('.').unwrap_or(host)
}
