//! Configuration at SaaS scale: rule selection with 20 rules against 20,000, and API
//! key lookup in a registry of 100 keys against 1,000,000. Matching walks a path trie and a key
//! lookup is one SHA-256 plus one hash-map probe, so both should cost about the same at any size.

// criterion_group! generates undocumented public functions.
#![allow(missing_docs)]

use std::fmt::Write;
use std::hint::black_box;
use std::path::Path;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use http::{HeaderMap, Method};
use tollgate::identity::keys::hash_key;
use tollgate::identity::KeyRegistry;
use tollgate::rules::{normalize, RequestInfo, RuleSet};

/// `n` rules on distinct paths of the shapes a large API has, plus a catch-all.
fn rules(n: usize) -> RuleSet {
    let mut y = String::from("rules:\n");
    for i in 0..n {
        let path = match i % 3 {
            0 => format!("/api/v{}/tenant{}/items", i % 5, i),
            1 => format!("/api/v{}/tenant{}/items/{{id}}", i % 5, i),
            _ => format!("/svc{i}/**"),
        };
        let key = ["user", "ip", "org"][i % 3];
        let _ = writeln!(
            y,
            "  - {{ name: r{i}, match: {{ path: \"{path}\" }}, key: {key}, limit: {}, window: 1m }}",
            100 + i
        );
    }
    y.push_str("  - { name: catch-all, match: { path: \"/**\" }, key: global, limit: 1000, window: 1h }\n");
    RuleSet::from_str_max(Path::new("bench.yaml"), &y, n + 1).expect("bench rules")
}

/// A registry of `n` keys; the key `k{i}` hashes to entry `i`.
fn registry(n: usize) -> KeyRegistry {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("keys.yaml");
    let mut y = String::with_capacity(n * 110);
    y.push_str("keys:\n");
    for i in 0..n {
        let _ = writeln!(
            y,
            "  - {{ id: c{i}, sha256: {}, tier: pro }}",
            hash_key(&format!("k{i}"))
        );
    }
    std::fs::write(&path, y).expect("write keys");
    KeyRegistry::load_max(&path, n).expect("keys")
}

fn bench_rules(c: &mut Criterion) {
    let headers = HeaderMap::new();
    let mut g = c.benchmark_group("config_scale/rule_selection");
    g.throughput(Throughput::Elements(1));
    for n in [20usize, 20_000] {
        let set = rules(n);
        let target = n / 2 - (n / 2) % 3 + 1; // a templated path near the middle of the file
        let path = normalize(&format!("/api/v{}/tenant{target}/items/42", target % 5)).into_owned();
        g.bench_function(format!("{n}_rules"), |b| {
            b.iter(|| {
                let info = RequestInfo {
                    method: &Method::GET,
                    method_override: None,
                    path: black_box(&path),
                    host: None,
                    headers: &headers,
                    tier: "free",
                };
                black_box(set.select(&info))
            })
        });
    }
    g.finish();
}

fn bench_keys(c: &mut Criterion) {
    let mut g = c.benchmark_group("config_scale/api_key_lookup");
    g.throughput(Throughput::Elements(1));
    g.sample_size(50);
    for n in [100usize, 1_000_000] {
        let reg = registry(n);
        let present = format!("k{}", n / 2);
        g.bench_function(format!("{n}_keys"), |b| {
            b.iter(|| black_box(reg.lookup(black_box(present.as_bytes())).is_some()))
        });
    }
    g.finish();
}

criterion_group!(benches, bench_rules, bench_keys);
criterion_main!(benches);
