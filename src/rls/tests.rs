//! The rate-limit service without a listener: config compile errors, matching, and decisions
//! on the memory store with a fake clock (tollgate's additions: algorithms, several limits,
//! all or nothing).

use std::path::Path;
use std::sync::Arc;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};

use super::config::{compile_domain, Domains};
use super::matcher::wildcard_match;
use super::Rls;
use crate::clock::FakeClock;
use crate::config::{EnvOverrides, GatewayConfig};
use crate::limiter::FailurePolicy;
use crate::state::State;

const NOW_US: u64 = 1_800_000_000_000_000;

fn compile_err(text: &str) -> String {
    match compile_domain(Path::new("d.yaml"), text, FailurePolicy::Open) {
        Ok(_) => panic!("compiled: {text}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn config_errors_name_file_line_and_column() {
    let e =
        compile_err("domain: d\ndescriptors:\n  - key: a\n    rate_limit: { unit: fortnight, requests_per_unit: 1 }\n");
    assert!(e.starts_with("d.yaml:4:"), "{e}");
    assert!(e.contains("invalid rate limit unit"), "{e}");
    let e = compile_err("domain: d\ndescriptors:\n  - key: a\n  - key: a\n");
    assert!(e.starts_with("d.yaml:4:"), "{e}");
    assert!(e.contains("duplicate descriptor composite key \"d.a\""), "{e}");
    let e = compile_err("domain: d\ndescriptors:\n  - key: a\n    value: b\n    share_threshold: true\n");
    assert!(e.contains("share_threshold can only be used with wildcard"), "{e}");
    let e = compile_err("domain: d\ndescriptors:\n  - key: a\n    rate_limit: { unlimited: true, unit: second }\n");
    assert!(e.contains("should not specify rate limit unit when unlimited"), "{e}");
    let e = compile_err("domain: d\ndescriptors:\n  - key: a\n    rate_limit: { name: x, unit: second, requests_per_unit: 1, replaces: [{ name: x }] }\n");
    assert!(e.contains("replaces should not contain name of same descriptor"), "{e}");
    let e = compile_err("domain: d\ndescriptors:\n  - key: a\n    rate_limt: {}\n");
    assert!(e.starts_with("d.yaml:4:"), "unknown fields are errors: {e}");
    let e = compile_err("descriptors: []\n");
    assert!(e.contains("empty domain"), "{e}");
    let e = compile_err("domain: d\ndescriptors:\n  - key: a\n    rate_limit: { unit: second, requests_per_unit: 5, algorithm: leaky_bucket }\n");
    assert!(e.starts_with("d.yaml:4:"), "{e}");
    assert!(e.contains("cannot be answered by a rate-limit service"), "{e}");
    let e = compile_err("domain: d\ndescriptors:\n  - key: a\n    failure: sometimes\n    rate_limit: { unit: second, requests_per_unit: 5 }\n");
    assert!(e.starts_with("d.yaml:4:"), "{e}");
    let e = compile_err("domain: d\ndescriptors:\n  - key: a\n    quota_mode: true\n");
    assert!(e.contains("quota_mode is not supported"), "{e}");
    // Numbers are text where envoyproxy/ratelimit reads strings.
    compile_domain(
        Path::new("d.yaml"),
        "domain: d\ndescriptors:\n  - key: n\n    value: 2061111111\n    rate_limit: { unit: DAY, requests_per_unit: 5 }\n",
        FailurePolicy::Open,
    )
    .unwrap_or_else(|e| panic!("{e}"));
}

#[test]
fn wildcards_match_as_envoyproxy_ratelimit_does() {
    let split = |p: &str| p.split('*').map(str::to_string).collect::<Vec<_>>();
    assert!(wildcard_match(&split("key_value*"), "key_value1"));
    assert!(wildcard_match(&split("key_value*"), "key_value"));
    assert!(!wildcard_match(&split("key_value*"), "key_valu"));
    assert!(wildcard_match(&split("path_/api/*/action"), "path_/api/123/action"));
    assert!(!wildcard_match(&split("path_/api/*/action"), "path_/api/123/other"));
    assert!(wildcard_match(&split("r_/a/*/b/*/c"), "r_/a/1/b/2/c"));
    assert!(!wildcard_match(&split("r_/a/*/b/*/c"), "r_/a/1/x/2/c"));
    // The fixed parts may not overlap.
    assert!(!wildcard_match(&split("k_ab*ba"), "k_aba"));
}

async fn rls(domains: &[(&str, &str)]) -> (tempfile::TempDir, Arc<Rls>) {
    let dir = tempfile::tempdir().unwrap();
    let cfg_dir = dir.path().join("config");
    std::fs::create_dir_all(&cfg_dir).unwrap();
    for (name, text) in domains {
        std::fs::write(cfg_dir.join(name), text).unwrap();
    }
    let gw = dir.path().join("gateway.yaml");
    std::fs::write(
        &gw,
        "upstream: { url: http://127.0.0.1:1 }\nrules_file: rules.yaml\nrls:\n  config_dir: config\n",
    )
    .unwrap();
    std::fs::write(dir.path().join("rules.yaml"), "rules: []\n").unwrap();
    let config = GatewayConfig::load(&gw, &EnvOverrides::default()).unwrap_or_else(|e| panic!("{e}"));
    let settings = config.rls.clone().unwrap();
    let state = State::with_clock(config, Arc::new(FakeClock::new(NOW_US)))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let rls = Rls::new(state, settings).unwrap_or_else(|e| panic!("{e}"));
    (dir, rls)
}

fn req(domain: &str, descriptors: &[&[(&str, &str)]], hits: u32) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.into(),
        descriptors: descriptors
            .iter()
            .map(|d| RateLimitDescriptor {
                entries: d
                    .iter()
                    .map(|(k, v)| Entry {
                        key: (*k).into(),
                        value: (*v).into(),
                    })
                    .collect(),
                ..RateLimitDescriptor::default()
            })
            .collect(),
        hits_addend: hits,
    }
}

async fn ask(r: &Rls, domain: &str, descriptors: &[&[(&str, &str)]]) -> RateLimitResponse {
    r.should_rate_limit(&req(domain, descriptors, 0))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
}

const TOLLGATE: &str = "domain: api
failure: closed
descriptors:
  - key: tenant
    rate_limit: { unit: second, requests_per_unit: 2, algorithm: token_bucket, capacity: 4 }
    limits:
      - { unit: day, requests_per_unit: 6 }
  - key: user
    rate_limit: { unit: minute, requests_per_unit: 3, algorithm: sliding_window }
";

#[tokio::test]
async fn several_limits_per_descriptor_bind_on_the_nearest() {
    let (_d, r) = rls(&[("api.yaml", TOLLGATE)]).await;
    // A burst of the bucket's capacity, then the bucket denies; the daily cap is untouched by
    // the denial.
    for n in 0..4u32 {
        let resp = ask(&r, "api", &[&[("tenant", "t")]]).await;
        assert_eq!(resp.overall_code, Code::Ok as i32, "call {n}: {resp:?}");
    }
    let resp = ask(&r, "api", &[&[("tenant", "t")]]).await;
    assert_eq!(resp.overall_code, Code::OverLimit as i32, "{resp:?}");
    let s = &resp.statuses[0];
    let limit = s.current_limit.as_ref().unwrap();
    assert_eq!(
        (limit.requests_per_unit, limit.unit),
        (2, 1),
        "the bucket binds: {resp:?}"
    );
    // A descriptor's status names its limit nearest to denying: the bucket (3 of 4 left;
    // the day cap has 5).
    let resp = ask(&r, "api", &[&[("tenant", "u")]]).await;
    let s = &resp.statuses[0];
    assert_eq!(s.current_limit.as_ref().unwrap().requests_per_unit, 2, "{resp:?}");
    assert_eq!(s.limit_remaining, 3, "{resp:?}");
}

#[tokio::test]
async fn a_request_one_descriptor_denies_spends_nothing_on_the_others() {
    let (_d, r) = rls(&[("api.yaml", TOLLGATE)]).await;
    for _ in 0..3 {
        ask(&r, "api", &[&[("user", "a")]]).await;
    }
    let resp = ask(&r, "api", &[&[("user", "b")], &[("user", "a")]]).await;
    assert_eq!(resp.overall_code, Code::OverLimit as i32, "{resp:?}");
    assert_eq!(resp.statuses[0].code, Code::Ok as i32);
    assert_eq!(resp.statuses[0].limit_remaining, 3, "nothing spent on b: {resp:?}");
    assert_eq!(resp.statuses[1].code, Code::OverLimit as i32);
    let resp = ask(&r, "api", &[&[("user", "b")]]).await;
    assert_eq!(resp.statuses[0].limit_remaining, 2, "{resp:?}");
}

#[tokio::test]
async fn unknown_domains_and_unmatched_descriptors_are_ok_without_a_limit() {
    let (_d, r) = rls(&[("api.yaml", TOLLGATE)]).await;
    let resp = ask(&r, "nope", &[&[("user", "a")]]).await;
    assert_eq!(resp.overall_code, Code::Ok as i32);
    assert!(resp.statuses[0].current_limit.is_none());
    let resp = ask(&r, "api", &[&[("user", "a"), ("deeper", "x")]]).await;
    assert!(resp.statuses[0].current_limit.is_none(), "depth must match: {resp:?}");
    let domains: &Domains = &r.domains();
    assert_eq!(domains.by_name.len(), 1);
}

/// Per configured limit, one series under its entry's name (envoyproxy/ratelimit's stats key);
/// `detailed_metric` names it by the request's values, `value_to_metric` shows the value of an
/// entry matched by its key alone or a wildcard; an unmatched descriptor moves no limit series.
#[tokio::test]
async fn each_limit_is_counted_under_its_descriptor_name_detailed_when_configured() {
    let domain = "domain: m
descriptors:
  - key: plain
    rate_limit: { unit: minute, requests_per_unit: 1 }
  - key: detailed
    detailed_metric: true
    rate_limit: { unit: minute, requests_per_unit: 5 }
  - key: route
    value: /api/*
    value_to_metric: true
    rate_limit: { unit: minute, requests_per_unit: 5 }
  - key: tenant
    descriptors:
      - key: user
        value_to_metric: true
        rate_limit: { unit: minute, requests_per_unit: 5 }
";
    let (_dir, r) = rls(&[("m.yaml", domain)]).await;
    ask(&r, "m", &[&[("plain", "a")]]).await;
    let over = ask(&r, "m", &[&[("plain", "b")]]).await;
    assert_eq!(over.overall_code, Code::Ok as i32, "each value its own counter");
    let over = ask(&r, "m", &[&[("plain", "a")]]).await;
    assert_eq!(over.overall_code, Code::OverLimit as i32);
    ask(&r, "m", &[&[("detailed", "x1")]]).await;
    ask(&r, "m", &[&[("route", "/api/v1")]]).await;
    ask(&r, "m", &[&[("tenant", "acme"), ("user", "ann")]]).await;
    ask(&r, "m", &[&[("nothing", "here")]]).await;
    let m = r.metrics();
    let get = |d: &str, outcome: &'static str| {
        m.limits
            .get_or_create(&crate::metrics::RlsLimitLabels {
                domain: "m".into(),
                descriptor: d.into(),
                outcome,
            })
            .get()
    };
    assert_eq!(get("m.plain", "within_limit"), 2);
    assert_eq!(get("m.plain", "over_limit"), 1);
    assert_eq!(get("m.detailed_x1", "within_limit"), 1);
    assert_eq!(get("m.detailed", "within_limit"), 0, "named by the request's value");
    assert_eq!(get("m.route_/api/v1", "within_limit"), 1);
    assert_eq!(
        get("m.tenant.user_ann", "within_limit"),
        1,
        "only the value_to_metric entry shows its value"
    );
    assert_eq!(m.detailed_overflow.get(), 0);
}
