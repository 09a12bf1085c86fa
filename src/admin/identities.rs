//! `/keys/{identity}`: every counter an identity value (a user id, key id, IP, org or header
//! value) can have under the loaded rules, and the hash it is logged under.

use std::net::IpAddr;

use crate::limiter::keys::{KeyBuilder, Namespace};
use crate::limiter::LimitCheck;
use crate::rules::runtime::RuntimeOverrides;
use crate::rules::KeyKind;
use crate::state::Snapshot;

/// One counter an identity value may have.
pub(super) struct Candidate {
    /// The check (cost 0) naming the counter.
    pub(super) check: LimitCheck,
    /// The name of the rule the counter belongs to.
    pub(super) rule: String,
    /// The rule's key kind.
    pub(super) kind: String,
    /// The rule's index in the snapshot.
    pub(super) planned_rule: u32,
    /// Which of its rule's spends the limit reserves for.
    pub(super) spend: u8,
    /// The rule certainly applies to this value (a registered key id's user rules, an IP's ip
    /// and user rules, a registered org's org rules); otherwise only when a counter exists.
    pub(super) certain: bool,
}

/// What `/keys/{identity}` knows about a value before looking at the store.
pub(super) struct Candidates {
    /// Every counter it may have.
    pub(super) checks: Vec<Candidate>,
    /// Known without counters: a registered key id or org, an IP, or an override's id.
    pub(super) known: bool,
    /// What the value was taken for: `api_key`, `ip`, `org` or `user` (a JWT user, a header value).
    pub(super) kind: &'static str,
}

/// Every counter an identity value (user id, key id, IP, org, header value) can have, with
/// the namespace each rule's key kind gives that value (see `limiter::keys`): a registered key
/// id is an API key, an address is an IP, anything else a JWT user.
pub(super) fn identity_checks(
    keys: &KeyBuilder,
    snap: &Snapshot,
    runtime: &RuntimeOverrides,
    who: &str,
    now_secs: u64,
) -> Candidates {
    let is_ip = who.parse::<IpAddr>().is_ok();
    let is_key = snap.keys.has_id(who);
    let is_org = snap.keys.entries().any(|(_, e)| e.org.as_deref() == Some(who));
    let caller_ns = if is_key {
        Namespace::ApiKey
    } else if is_ip {
        Namespace::Ip
    } else {
        Namespace::Jwt
    };
    // The caller's tier is known for a registered key (its tier) and for an IP as a caller
    // (anonymous): a `user` rule for another tier applies only if a counter says it once did
    // (the key's tier changed). `ip` and `org` rules are shared by callers of every tier.
    let key_tier: Option<std::sync::Arc<str>> = match snap.keys.entries().find(|(_, e)| &*e.id == who) {
        Some((_, e)) => Some(e.tier.clone()),
        None if is_ip => Some(std::sync::Arc::from(crate::identity::ANONYMOUS)),
        None => None,
    };
    let mut checks = Vec::new();
    let mut has_override = false;
    for (ri, r) in snap.rules.rules.iter().enumerate() {
        let other_tier =
            r.key == KeyKind::User && matches!((&r.tier, &key_tier), (Some(t), Some(k)) if t.as_str() != &**k);
        let (ns, certain) = match r.key {
            KeyKind::Global => continue,
            KeyKind::User => (caller_ns, is_key || is_ip),
            KeyKind::Ip if is_ip => (Namespace::Ip, true),
            KeyKind::Ip => continue,
            KeyKind::Org if is_ip => continue,
            KeyKind::Org => (Namespace::Org, is_org),
            KeyKind::Header(_) => (Namespace::Header, false),
        };
        let over = r.overrides.get(who);
        has_override |= over.is_some();
        // The keys the proxy would use for this value: the plan's own key builder.
        let value = crate::rules::KeyValue::Value(ns, who.as_bytes());
        let ri = u32::try_from(ri).unwrap_or(u32::MAX);
        let who_id = crate::identity::IdText::from(who);
        let cx = crate::engine::plan::PlanContext {
            snap,
            runtime,
            keys,
            now_secs,
        };
        let mut planned = crate::engine::plan::Planned::default();
        crate::engine::plan::rule_checks(cx, ri, value, &who_id, &mut planned);
        for p in planned.checks {
            checks.push(Candidate {
                check: LimitCheck { cost: 0, ..p.check },
                planned_rule: p.rule,
                spend: p.spend,
                rule: r.name.to_string(),
                kind: r.key.to_text(),
                certain: (certain && !other_tier) || over.is_some(),
            });
        }
    }
    let kind = if is_key {
        "api_key"
    } else if is_ip {
        "ip"
    } else if is_org {
        "org"
    } else {
        "user"
    };
    Candidates {
        checks,
        known: is_key || is_ip || is_org || has_override,
        kind,
    }
}

/// The namespace a caller value hashes in: a registered key id is an API key, an address an
/// IP, anything else a JWT user (as in `identity_checks`).
pub(super) fn caller_namespace(snap: &Snapshot, who: &str) -> Namespace {
    if snap.keys.has_id(who) {
        Namespace::ApiKey
    } else if who.parse::<IpAddr>().is_ok() {
        Namespace::Ip
    } else {
        Namespace::Jwt
    }
}

/// The hash an identity value is logged under (its caller namespace).
pub(super) fn identity_hash(keys: &KeyBuilder, snap: &Snapshot, who: &str) -> String {
    keys.tag(caller_namespace(snap, who), who.as_bytes()).to_string()
}
