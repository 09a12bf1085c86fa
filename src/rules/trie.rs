//! Matching: the path trie and the choice of the most specific rule of each key kind.

use std::collections::{HashMap, HashSet};

use super::path::{self, Pattern};
use super::{Candidate, KeyKind, RequestInfo, RuleSet, Selection};
use http::HeaderName;

/// One trie node: the rules whose path pattern reaches this segment.
#[derive(Debug, Clone, Default)]
pub(super) struct Node {
    /// Children by literal segment.
    literal: HashMap<Box<str>, Node>,
    /// The child for `{param}` / `*`.
    any: Option<Box<Node>>,
    /// Rules whose pattern ends exactly here.
    end: Vec<u32>,
    /// Rules `<here>/**`: they match here and everything below.
    subtree: Vec<u32>,
}

impl Node {
    pub(super) fn insert(&mut self, p: &Pattern, rule: u32) {
        let mut n = self;
        for seg in &p.segments {
            n = match seg {
                path::Segment::Literal(l) => n.literal.entry(Box::from(l.as_str())).or_default(),
                path::Segment::Any => n.any.get_or_insert_with(Box::default),
            };
        }
        if p.subtree {
            n.subtree.push(rule);
        } else {
            n.end.push(rule);
        }
    }

    /// Call `f` for every rule whose path pattern matches `rest` (a normalised path suffix).
    /// Recursion depth is bounded by the trie's depth, not the path's.
    pub(super) fn walk(&self, rest: &str, f: &mut impl FnMut(u32)) {
        self.subtree.iter().for_each(|&i| f(i));
        let rest = rest.trim_start_matches('/');
        if rest.is_empty() {
            self.end.iter().for_each(|&i| f(i));
            return;
        }
        let (seg, tail) = rest.split_once('/').unwrap_or((rest, ""));
        if let Some(n) = self.literal.get(seg) {
            n.walk(tail, f);
        }
        if let Some(n) = &self.any {
            n.walk(tail, f);
        }
    }
}

impl RuleSet {
    /// Build the matcher: key-kind slots and the path trie.
    pub(super) fn index(&mut self) {
        let mut kinds: Vec<KeyKind> = self.rules.iter().map(|r| r.key.clone()).collect();
        kinds.sort_by_key(|k| k.to_text());
        kinds.dedup();
        self.kind_slot = self
            .rules
            .iter()
            .map(|r| kinds.iter().position(|k| *k == r.key).map_or(0, |p| p as u32))
            .collect();
        self.kinds = kinds;
        let (mut trie, mut trie_ci) = (Node::default(), Node::default());
        for (i, r) in self.rules.iter().enumerate() {
            if r.ignore_case {
                trie_ci.insert(&r.pattern, i as u32);
            } else {
                trie.insert(&r.pattern, i as u32);
            }
        }
        self.trie = trie;
        self.trie_ci = trie_ci;
        self.uses_host = self.rules.iter().any(|r| r.host.is_some());
        self.uses_ignore_case = self.rules.iter().any(|r| r.ignore_case);
        self.uses_method_override = self.rules.iter().any(|r| r.method_override && r.methods.is_some());
        let mut read: Vec<HeaderName> = Vec::new();
        for r in &self.rules {
            if let KeyKind::Header(h) = &r.key {
                read.push(h.clone());
            }
            read.extend(r.headers.iter().map(|(h, _)| h.clone()));
        }
        if self.uses_method_override {
            for n in super::METHOD_OVERRIDE_HEADERS {
                read.push(HeaderName::from_static(n));
            }
        }
        read.sort_by(|a, b| a.as_str().cmp(b.as_str()));
        read.dedup();
        self.read_headers = read;
    }

    /// The chosen rule of each key kind for `req` (rule indices, one per kind that matched).
    pub fn select(&self, req: &RequestInfo<'_>) -> Selection {
        let mut best: [Option<u32>; 8] = [None; 8];
        let mut extra: Vec<Option<u32>> = Vec::new();
        if self.kinds.len() > best.len() {
            extra = vec![None; self.kinds.len()];
        }
        let mut visit = |i: u32| {
            let slot = self.kind_slot[i as usize] as usize;
            let cur = if extra.is_empty() {
                &mut best[slot]
            } else {
                &mut extra[slot]
            };
            let r = &self.rules[i as usize];
            if let Some(c) = *cur {
                let c = &self.rules[c as usize];
                if c.specificity > r.specificity || (c.specificity == r.specificity && c.index < r.index) {
                    return;
                }
            }
            // The trie matched the path; check the other conditions.
            if r.matches_conditions(req) {
                *cur = Some(i);
            }
        };
        self.trie.walk(req.path, &mut visit);
        if self.uses_ignore_case {
            self.trie_ci.walk(&super::lower(req.path), &mut visit);
        }
        if extra.is_empty() {
            best.iter().flatten().copied().collect()
        } else {
            extra.into_iter().flatten().collect()
        }
    }

    /// Every rule that matches `req`, marking the chosen one of each kind (for `explain`).
    pub fn explain(&self, req: &RequestInfo<'_>) -> Vec<Candidate> {
        let chosen: HashSet<u32> = self.select(req).into_iter().collect();
        let mut out: Vec<Candidate> = (0..self.rules.len() as u32)
            .filter(|i| self.rules[*i as usize].matches(req))
            .map(|rule| Candidate {
                rule,
                chosen: chosen.contains(&rule),
            })
            .collect();
        out.sort_by_key(|c| {
            (
                self.kind_slot[c.rule as usize],
                std::cmp::Reverse(self.rules[c.rule as usize].specificity),
                c.rule,
            )
        });
        out
    }
}
