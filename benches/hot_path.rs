//! Micro-benchmarks of the request path's pure parts: rule matching over 1,000 rules, identity
//! extraction (JWT verification included), memory-store decisions, and store-key building.

// criterion_group! generates undocumented public functions.
#![allow(missing_docs)]

use std::hint::black_box;
use std::num::NonZeroU64;
use std::path::Path;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use http::{HeaderMap, HeaderValue, Method};
use tollgate::clock::SystemClock;
use tollgate::config::{parse_str, raw::RawGateway, EnvOverrides, GatewayConfig};
use tollgate::identity::{identify, KeyRegistry};
use tollgate::limiter::keys::{KeyBuilder, Namespace};
use tollgate::limiter::memory::MemoryStore;
use tollgate::limiter::{Algorithm, LimitCheck, Quota};
use tollgate::rules::{normalize, RequestInfo, RuleSet};

fn thousand_rules() -> RuleSet {
    let mut y = String::from("rules:\n");
    for i in 0..1000 {
        let path = match i % 4 {
            0 => format!("/api/v{}/resource{}", i % 7, i),
            1 => format!("/api/v{}/items{}/{{id}}", i % 7, i),
            2 => format!("/svc{}/**", i),
            _ => format!("/api/v{}/things{}/*/detail", i % 7, i),
        };
        let key = ["user", "ip", "global", "org"][i % 4];
        y.push_str(&format!(
            "  - {{ name: r{i}, match: {{ path: \"{path}\" }}, key: {key}, limit: {}, window: 1m }}\n",
            100 + i
        ));
    }
    y.push_str("  - { name: catch-all, match: { path: \"/**\" }, key: user, limit: 1000, window: 1h }\n");
    RuleSet::from_str(Path::new("bench.yaml"), &y).expect("bench rules")
}

fn bench_matching(c: &mut Criterion) {
    let set = thousand_rules();
    let h = HeaderMap::new();
    let mut g = c.benchmark_group("rules");
    g.throughput(Throughput::Elements(1));
    for (name, path) in [
        ("exact", "/api/v3/resource500"),
        ("template", "/api/v1/items501/42"),
        ("fallthrough", "/nothing/here/at/all"),
        ("needs_normalising", "/api/v3//resource500/"),
    ] {
        g.bench_function(format!("select_1000_rules/{name}"), |b| {
            b.iter(|| {
                let norm = normalize(black_box(path));
                let info = RequestInfo {
                    method: &Method::GET,
                    method_override: None,
                    path: &norm,
                    host: None,
                    headers: &h,
                    tier: "free",
                };
                black_box(set.select(&info))
            })
        });
    }
    g.finish();
}

fn bench_identity(c: &mut Criterion) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/jwt");
    let path = dir.join("gateway.yaml");
    let yaml = "upstream: { url: http://127.0.0.1:1 }\nidentity:\n  trusted_proxies: [10.0.0.0/8]\n  jwt:\n    algorithms: [RS256]\n    public_key_file: rsa_public.pem\n";
    let raw: RawGateway = parse_str(&path, yaml).expect("yaml");
    let cfg = GatewayConfig::compile(&path, raw, &EnvOverrides::default())
        .expect("config")
        .identity;
    let key = jsonwebtoken::EncodingKey::from_rsa_pem(&std::fs::read(dir.join("rsa_private.pem")).expect("pem"))
        .expect("key");
    let claims = serde_json::json!({"sub": "alice", "tier": "pro", "exp": 4_000_000_000u64});
    let token = jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::RS256),
        &claims,
        &key,
    )
    .expect("jwt");
    let keys_yaml = format!(
        "keys:\n  - {{ id: k, sha256: {}, tier: pro }}\n",
        tollgate::identity::keys::hash_key("secret")
    );
    let keys = KeyRegistry::compile(
        Path::new("k.yaml"),
        parse_str(Path::new("k.yaml"), &keys_yaml).expect("keys"),
    )
    .expect("keys");
    let peer = "10.1.1.1".parse().expect("ip");
    let mut g = c.benchmark_group("identity");
    g.throughput(Throughput::Elements(1));
    let mut ip = HeaderMap::new();
    ip.insert("x-forwarded-for", HeaderValue::from_static("203.0.113.9, 10.0.0.2"));
    g.bench_function("ip_via_trusted_xff", |b| {
        b.iter(|| black_box(identify(black_box(&ip), peer, &keys, &cfg, 1_800_000_000)))
    });
    let mut api = HeaderMap::new();
    api.insert("x-api-key", HeaderValue::from_static("secret"));
    g.bench_function("api_key", |b| {
        b.iter(|| black_box(identify(black_box(&api), peer, &keys, &cfg, 1_800_000_000)))
    });
    let mut jwt = HeaderMap::new();
    jwt.insert(
        "authorization",
        HeaderValue::from_str(&format!("Bearer {token}")).expect("hv"),
    );
    g.bench_function("jwt_rs256_verify", |b| {
        b.iter(|| black_box(identify(black_box(&jwt), peer, &keys, &cfg, 1_800_000_000)))
    });
    g.finish();
}

fn bench_memory_store(c: &mut Criterion) {
    let store = MemoryStore::new(Arc::new(SystemClock), 1_000_000);
    let kb = KeyBuilder {
        prefix: "tl".into(),
        salt: String::new(),
    };
    let mut g = c.benchmark_group("memory_store");
    g.throughput(Throughput::Elements(1));
    for alg in [
        Algorithm::TokenBucket,
        Algorithm::FixedWindow,
        Algorithm::SlidingWindow,
        Algorithm::SlidingLog,
    ] {
        let q = if alg.is_bucket() {
            Quota::bucket(
                alg,
                NonZeroU64::new(1_000_000).expect("nz"),
                NonZeroU64::new(1).expect("nz"),
            )
        } else {
            Quota::window(
                alg,
                NonZeroU64::new(100).expect("nz"),
                NonZeroU64::new(1_000_000).expect("nz"),
            )
        };
        let keys: Vec<LimitCheck> = (0..1024)
            .map(|i| LimitCheck {
                key: kb.key(&kb.tag(Namespace::Jwt, format!("user{i}").as_bytes()), "r", 0),
                quota: q,
                cost: 1,
                shadow: false,
                holder: 0,
                penalty: None,
                lease: None,
            })
            .collect();
        let mut i = 0usize;
        let mut now = 1_800_000_000_000_000u64;
        g.bench_function(format!("decision/{}", alg.as_str()), |b| {
            b.iter(|| {
                i = (i + 1) & 1023;
                now += 3;
                black_box(store.check_at(std::slice::from_ref(&keys[i]), now))
            })
        });
    }
    g.bench_function("store_key_build", |b| {
        b.iter(|| {
            let tag = kb.tag(Namespace::Ip, black_box(b"203.0.113.9"));
            black_box(kb.key(&tag, "search", 0))
        })
    });
    g.finish();
}

/// The token-usage scan of a response body (`cost_from: {json: …}`): an OpenAI event stream of
/// ~2 KB (the bench/run `tokens` row's), and a 1 MB JSON completion with its usage at the end.
fn bench_usage_scan(c: &mut Criterion) {
    use tollgate::usage::{BodyKind, JsonPath, Scanner};
    let paths = [JsonPath::parse("usage.total_tokens").expect("a valid path")];
    let mut sse = String::new();
    for _ in 0..10 {
        sse.push_str("data: {\"id\":\"chatcmpl-bench\",\"object\":\"chat.completion.chunk\",\"created\":1796600000,\"model\":\"bench\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"word word word \"},\"finish_reason\":null}],\"usage\":null}\n\n");
    }
    sse.push_str("data: {\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":30,\"total_tokens\":42}}\n\ndata: [DONE]\n\n");
    let big = format!(
        "{{\"id\":\"x\",\"choices\":[{{\"message\":{{\"role\":\"assistant\",\"content\":\"{}\"}}}}],\"usage\":{{\"total_tokens\":42}}}}",
        "word \\\"quoted\\\" ".repeat(1_000_000 / 16)
    );
    let mut g = c.benchmark_group("usage_scan");
    for (name, body, kind) in [
        ("event_stream_2kb", sse.as_bytes(), BodyKind::EventStream),
        ("json_1mb", big.as_bytes(), BodyKind::Json),
    ] {
        g.throughput(Throughput::Bytes(body.len() as u64));
        g.bench_function(name, |b| {
            b.iter(|| {
                let mut s = Scanner::new(&paths, kind);
                for chunk in body.chunks(16 * 1024) {
                    s.feed(chunk);
                }
                s.finish();
                assert_eq!(s.found(0), Some(42));
            })
        });
    }
    g.finish();
}

criterion_group!(
    benches,
    bench_matching,
    bench_identity,
    bench_memory_store,
    bench_usage_scan
);
criterion_main!(benches);
