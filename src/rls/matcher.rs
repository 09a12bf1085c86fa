//! Which configured descriptor entry a request's descriptor matches, exactly as
//! envoyproxy/ratelimit's `GetLimit` walks its tree: the entries form a path; at each level
//! `key_value` is looked up first, then the wildcard patterns in file order, then `key` alone
//! (a key without a value matches any value); a limit applies only when it sits at the
//! request's last entry (the same depth); a wildcard with `share_threshold` puts the pattern
//! instead of the value into the counter's key. Pure.

use std::sync::Arc;

use smallvec::SmallVec;

use super::config::{Domain, Limits, Node};

/// A descriptor's match.
#[derive(Debug)]
pub struct Matched<'a> {
    /// The limits of the matched entry.
    pub limits: &'a Arc<Limits>,
    /// Per request entry: the value its counter is keyed by (the request's, or the
    /// `share_threshold` wildcard pattern every matching value shares).
    pub values: SmallVec<[&'a str; 4]>,
    /// The metric name of this match when it shows request values, as envoyproxy/ratelimit's
    /// stats do: every entry's `key_value` under `detailed_metric`, or, under
    /// `value_to_metric`, the value of an entry matched by a wildcard or by its key alone.
    /// `None`: the entry's own name ([`Limits::metric`]).
    pub detailed: Option<String>,
}

/// envoyproxy/ratelimit's wildcard match of a `key_value` against a pattern split on `*`:
/// each `*` matches any run of characters (none included), in order.
pub fn wildcard_match(parts: &[String], value: &str) -> bool {
    let (Some(first), Some(last)) = (parts.first(), parts.last()) else {
        return false;
    };
    if parts.len() == 1 {
        return first == value;
    }
    if !value.starts_with(first.as_str()) || !value.ends_with(last.as_str()) {
        return false;
    }
    let fixed: usize = parts.iter().map(String::len).sum();
    if value.len() < fixed {
        return false;
    }
    let mut rest = &value[first.len()..value.len() - last.len()];
    for part in &parts[1..parts.len() - 1] {
        match rest.find(part.as_str()) {
            Some(i) => rest = &rest[i + part.len()..],
            None => return false,
        }
    }
    true
}

/// The entry `entries` (key, value pairs) match in `domain`, if one with limits does.
pub fn find<'a>(domain: &'a Domain, entries: &[(&'a str, &'a str)]) -> Option<Matched<'a>> {
    let mut node: &'a Node = &domain.root;
    let mut found: Option<&'a Arc<Limits>> = None;
    let mut values: SmallVec<[&'a str; 4]> = entries.iter().map(|(_, v)| *v).collect();
    // Per matched level, the configured name of the entry when it differs from the request's
    // `key_value` (a wildcard pattern, or a key alone); `None` when the name shows the value.
    let mut names: SmallVec<[Option<&'a str>; 4]> = SmallVec::new();
    let mut shows_value = false;
    let mut final_key = String::new();
    for (i, (key, value)) in entries.iter().enumerate() {
        final_key.clear();
        final_key.push_str(key);
        final_key.push('_');
        final_key.push_str(value);
        let mut next = node.children.get(final_key.as_str());
        let mut name = None;
        let mut by_wildcard = false;
        if next.is_none() {
            for (pattern, parts) in &node.wildcards {
                if wildcard_match(parts, &final_key) {
                    next = node.children.get(pattern.as_str());
                    by_wildcard = next.is_some();
                    name = Some(pattern.as_str());
                    break;
                }
            }
        }
        if next.is_none() {
            next = node.children.get(*key);
            name = Some(*key);
        }
        let Some(n) = next else { break };
        if n.value_to_metric && name.is_some() {
            name = None;
            shows_value = true;
        }
        names.push(name);
        if by_wildcard {
            if let Some(p) = &n.share_pattern {
                // The pattern's value part: every value it matches shares one counter.
                values[i] = p
                    .strip_prefix(key)
                    .and_then(|p| p.strip_prefix('_'))
                    .unwrap_or(p.as_str());
            }
        }
        if i + 1 == entries.len() {
            found = n.limits.as_ref();
        }
        if n.children.is_empty() {
            break;
        }
        node = n;
    }
    let limits = found?;
    let detailed = (limits.detailed_metric || shows_value).then(|| {
        let mut m = domain.name.clone();
        for ((key, value), name) in entries.iter().zip(&names) {
            m.push('.');
            match name {
                Some(n) if !limits.detailed_metric => m.push_str(n),
                _ => {
                    m.push_str(key);
                    m.push('_');
                    m.push_str(value);
                }
            }
        }
        m
    });
    Some(Matched {
        limits,
        values,
        detailed,
    })
}
