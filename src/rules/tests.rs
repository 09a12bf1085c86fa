//! Specificity and validation tests. Validation fixtures live in `tests/fixtures/rules/`, one
//! file per error, each starting with `# expect: <line>:<col> <message part>`.

use std::path::Path;
use std::sync::Arc;

use http::{HeaderMap, HeaderValue, Method};

use super::*;
use crate::identity::{Identity, IdentityKind};

fn rules(yaml: &str) -> RuleSet {
    RuleSet::from_str(Path::new("rules.yaml"), yaml).unwrap_or_else(|e| panic!("{e}"))
}

fn chosen(set: &RuleSet, method: &str, path: &str, tier: &str, headers: &HeaderMap) -> Vec<String> {
    let m = Method::from_bytes(method.as_bytes()).unwrap();
    let norm = normalize(path);
    let overridden = super::method_override(headers);
    let info = RequestInfo {
        method: &m,
        method_override: overridden.as_ref(),
        path: &norm,
        host: Some("api.example"),
        headers,
        tier,
    };
    let mut names: Vec<String> = set
        .select(&info)
        .into_iter()
        .map(|i| set.rules[i as usize].name.to_string())
        .collect();
    names.sort();
    names
}

const SPEC: &str = r#"
rules:
  - { name: all-user,       match: { path: "/**" },                                key: user, limit: 1000, window: 1h }
  - { name: api-user,       match: { path: "/api/**" },                            key: user, limit: 100, window: 1m }
  - { name: v1-user,        match: { path: "/api/v1/**" },                         key: user, limit: 50, window: 1m }
  - { name: user-by-id,     match: { path: "/api/v1/users/{id}" },                 key: user, limit: 20, window: 1m }
  - { name: users-me,       match: { path: "/api/v1/users/me" },                   key: user, limit: 10, window: 1m }
  - { name: users-me-post,  match: { path: "/api/v1/users/me", methods: [POST] },  key: user, limit: 5, window: 1m }
  - { name: search-any,     match: { path: /api/v1/search },                        key: user, limit: 30, window: 1m }
  - { name: search-free,    match: { path: /api/v1/search, tier: free },            key: user, limit: 5, window: 1m }
  - { name: login-ip,       match: { path: /api/v1/login, methods: [POST] },        key: ip, algorithm: sliding_log, limit: 5, window: 15m }
  - { name: all-ip,         match: { path: "/**" },                                key: ip, limit: 5000, window: 1h }
  - { name: search-global,  match: { path: /api/v1/search },                        key: global, limit: 10000, window: 1s }
  - { name: beta-header,    match: { path: "/api/**", header: { X-Beta: "1" } },   key: "header:X-Client", limit: 3, window: 1s }
  - { name: files,          match: { path: "/api/v1/files/*", methods: [POST, PUT] }, key: user, algorithm: token_bucket, rate: 10/s, capacity: 100, cost: 5 }
"#;

#[test]
fn most_specific_per_key_kind_and_all_kinds_apply() {
    let set = rules(SPEC);
    let h = HeaderMap::new();
    let table: &[(&str, &str, &str, &[&str])] = &[
        ("GET", "/", "anonymous", &["all-ip", "all-user"]),
        ("GET", "/api/x", "anonymous", &["all-ip", "api-user"]),
        ("GET", "/api/v1/x/y", "anonymous", &["all-ip", "v1-user"]),
        // template beats prefix; exact beats template
        ("GET", "/api/v1/users/42", "pro", &["all-ip", "user-by-id"]),
        ("GET", "/api/v1/users/me", "pro", &["all-ip", "users-me"]),
        // method-specific beats any method
        ("POST", "/api/v1/users/me", "pro", &["all-ip", "users-me-post"]),
        // tier-specific beats any tier; the global rule applies too
        (
            "GET",
            "/api/v1/search",
            "free",
            &["all-ip", "search-free", "search-global"],
        ),
        (
            "GET",
            "/api/v1/search",
            "pro",
            &["all-ip", "search-any", "search-global"],
        ),
        // per-IP login rule and the per-user prefix rule both apply
        ("POST", "/api/v1/login", "anonymous", &["login-ip", "v1-user"]),
        ("GET", "/api/v1/login", "anonymous", &["all-ip", "v1-user"]),
        // normalisation: bypass spellings hit the same rules
        ("POST", "/api/v1//login", "anonymous", &["login-ip", "v1-user"]),
        ("POST", "/api/v1/%6Cogin", "anonymous", &["login-ip", "v1-user"]),
        ("POST", "/api/x/../v1/login/", "anonymous", &["login-ip", "v1-user"]),
        ("POST", "/api/v1/files/report.pdf", "pro", &["all-ip", "files"]),
        ("GET", "/api/v1/files/report.pdf", "pro", &["all-ip", "v1-user"]),
    ];
    for (m, p, tier, want) in table {
        assert_eq!(chosen(&set, m, p, tier, &h), *want, "{m} {p} tier={tier}");
    }
    let mut beta = HeaderMap::new();
    beta.insert("x-beta", HeaderValue::from_static("1"));
    assert_eq!(
        chosen(&set, "GET", "/api/x", "free", &beta),
        ["all-ip", "api-user", "beta-header"]
    );
}

#[test]
fn overrides_replace_limits_for_one_identity() {
    let set = rules(
        "rules:\n  - name: d\n    match: { path: \"/**\" }\n    key: user\n    limit: 1000\n    window: 1h\n    overrides: { cust_42: { limit: 10000 }, cust_7: { limits: [ {limit: 1, window: 1s}, {limit: 5, window: 1m} ] } }\n",
    );
    let r = &set.rules[0];
    let id = |s: &str| Identity {
        kind: IdentityKind::ApiKey,
        id: s.into(),
        tier: Arc::from("pro"),
        org: None,
        ip: "1.2.3.4".parse().unwrap(),
    };
    assert_eq!(r.limits_for(&id("someone"))[0].limit.get(), 1000);
    let o = r.limits_for(&id("cust_42"));
    assert_eq!((o[0].limit.get(), o[0].window_us.get()), (10000, 3_600_000_000));
    assert_eq!(r.limits_for(&id("cust_7")).len(), 2);
}

#[test]
fn rates_parse() {
    assert_eq!(parse_rate("10/s").unwrap().get(), 100_000);
    assert_eq!(parse_rate("1000/h").unwrap().get(), 3_600_000);
    assert_eq!(parse_rate("5/500ms").unwrap().get(), 100_000);
    assert!(parse_rate("0/s").is_err());
    assert!(parse_rate("ten/s").is_err());
}

#[test]
fn validation_fixtures_name_line_column_and_reason() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/rules");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        let expect = text
            .lines()
            .next()
            .and_then(|l| l.strip_prefix("# expect: "))
            .unwrap_or_else(|| panic!("{}: no expect line", path.display()));
        let (pos, msg) = expect.split_once(' ').unwrap();
        let err = match RuleSet::from_str(&path, &text) {
            Ok(_) => panic!("{}: was accepted", path.display()),
            Err(e) => e,
        };
        let shown = err.to_string();
        assert!(
            shown.starts_with(&format!("{}:{pos}:", path.display())),
            "{}: got {shown}",
            path.display()
        );
        assert!(shown.contains(msg.trim()), "{}: got {shown}", path.display());
        n += 1;
    }
    assert!(n >= 13, "only {n} fixtures");
}

/// The trie finds exactly what a scan of every rule would.
#[test]
fn trie_selection_equals_brute_force() {
    let set = rules(SPEC);
    let h = HeaderMap::new();
    let brute = |m: &Method, path: &str, tier: &str| -> Vec<u32> {
        let info = RequestInfo {
            method: m,
            method_override: None,
            path,
            host: Some("api.example"),
            headers: &h,
            tier,
        };
        let mut best: HashMap<String, u32> = HashMap::new();
        for (i, r) in set.rules.iter().enumerate() {
            if !r.matches(&info) {
                continue;
            }
            let k = r.key.to_text();
            let better = match best.get(&k) {
                None => true,
                Some(&b) => {
                    let b = &set.rules[b as usize];
                    r.specificity > b.specificity || (r.specificity == b.specificity && r.index < b.index)
                }
            };
            if better {
                best.insert(k, i as u32);
            }
        }
        let mut v: Vec<u32> = best.into_values().collect();
        v.sort();
        v
    };
    let segs = [
        "api", "v1", "users", "me", "42", "search", "login", "files", "x", "", "v2",
    ];
    let mut n = 0;
    for a in segs {
        for b in segs {
            for c in segs {
                for d in ["", "users", "me", "report.pdf"] {
                    let path = normalize(&format!("/{a}/{b}/{c}/{d}")).into_owned();
                    for (m, tier) in [(Method::GET, "free"), (Method::POST, "pro"), (Method::PUT, "anonymous")] {
                        let info = RequestInfo {
                            method: &m,
                            method_override: None,
                            path: &path,
                            host: Some("api.example"),
                            headers: &h,
                            tier,
                        };
                        let mut got = set.select(&info);
                        got.sort();
                        assert_eq!(got.to_vec(), brute(&m, &path, tier), "{m} {path} {tier}");
                        n += 1;
                    }
                }
            }
        }
    }
    assert!(n > 10_000);
}

#[test]
fn rules_lease_unless_they_opt_out_or_cannot() {
    let set = rules(
        r#"rules:
  - { name: plain, match: { path: "/a" }, key: ip, limit: 10, window: 1m }
  - { name: opted-out, match: { path: "/b" }, key: ip, limit: 10, window: 1m, lease: false }
  - { name: shadow, match: { path: "/c" }, key: ip, limit: 10, window: 1m, shadow: true }
  - { name: boxed, match: { path: "/d" }, key: ip, limit: 10, window: 1m, penalty: 1m }
  - { name: counted, match: { path: "/e" }, key: ip, limit: 10, window: 1m, count_when: { status: [200] } }
"#,
    );
    let lease: Vec<(&str, bool)> = set.rules.iter().map(|r| (&*r.name, r.lease)).collect();
    assert_eq!(
        lease,
        [
            ("plain", true),
            ("opted-out", false),
            ("shadow", false),
            ("boxed", false),
            ("counted", false)
        ]
    );
}

#[test]
fn ignore_case_rules_match_any_spelling_of_their_path() {
    let set = rules(
        r#"
rules:
  - { name: login, match: { path: /api/v1/Login, methods: [POST], ignore_case: true }, key: ip, limit: 1, window: 1h }
  - { name: exact-case, match: { path: /api/v1/Search }, key: user, limit: 1, window: 1h }
"#,
    );
    let h = HeaderMap::new();
    for p in ["/api/v1/login", "/API/v1/LOGIN", "/Api/V1/LoGiN/"] {
        assert_eq!(chosen(&set, "POST", p, "free", &h), vec!["login"], "{p}");
    }
    // Characters whose Unicode case folds to ASCII, as Python, Java and JS routers fold them:
    // dotless i (`ı` -> `i`), LONG S (`ſ` -> `s`), KELVIN SIGN (`K` -> `k`).
    for p in ["/api/v1/log%C4%B1n", "/api/v1/LOG%C4%B1N"] {
        assert_eq!(chosen(&set, "POST", p, "free", &h), vec!["login"], "{p}");
    }
    let long_s = rules("rules:\n  - { name: tasks, match: { path: /api/v1/tasks, ignore_case: true }, key: ip, limit: 1, window: 1h }\n");
    for p in ["/api/v1/ta%C5%BFks", "/api/v1/tas%E2%84%AAs", "/api/v1/TA%C5%BFKS"] {
        assert_eq!(chosen(&long_s, "GET", p, "free", &h), vec!["tasks"], "{p}");
    }
    // Other escapes stay what they are.
    assert!(chosen(&long_s, "GET", "/api/v1/ta%C3%9Fks", "free", &h).is_empty());
    assert_eq!(chosen(&set, "GET", "/api/v1/Search", "free", &h), vec!["exact-case"]);
    assert!(chosen(&set, "GET", "/api/v1/search", "free", &h).is_empty());
}

#[test]
fn method_conditions_read_method_override_headers_unless_told_not_to() {
    let set = rules(
        r#"
rules:
  - { name: post-only, match: { path: /api/v1/login, methods: [POST] }, key: ip, limit: 1, window: 1h }
  - { name: no-override, match: { path: /api/v1/other, methods: [POST], method_override: false }, key: ip, limit: 1, window: 1h }
"#,
    );
    let mut h = HeaderMap::new();
    assert!(chosen(&set, "GET", "/api/v1/login", "free", &h).is_empty());
    for name in ["x-http-method-override", "x-http-method", "x-method-override"] {
        let mut h = HeaderMap::new();
        h.insert(name, HeaderValue::from_static("post"));
        assert_eq!(
            chosen(&set, "GET", "/api/v1/login", "free", &h),
            vec!["post-only"],
            "{name}"
        );
        assert!(chosen(&set, "GET", "/api/v1/other", "free", &h).is_empty(), "{name}");
    }
    h.insert("x-http-method-override", HeaderValue::from_static("not a method"));
    assert!(chosen(&set, "GET", "/api/v1/login", "free", &h).is_empty());
    assert!(set.uses_method_override);
}

/// `cost_from.in_flight`: as written, else `max(2, least limit / (max - cost))`, and none when
/// `max` is the estimate; the cap is a concurrency quota with the slot time to live.
#[test]
fn cost_from_caps_requests_in_flight() {
    let set = rules(
        r#"rules:
  - { name: given, match: { path: "/a" }, key: ip, algorithm: token_bucket, rate: 1/s, capacity: 10000, cost: 100, cost_from: { header: X-Cost, max: 5000, in_flight: 7 } }
  - { name: default, match: { path: "/b" }, key: ip, algorithm: fixed_window, limits: [{ limit: 100000, window: 1h }, { limit: 20000, window: 1m }], cost: 100, cost_from: { header: X-Cost, max: 1100 } }
  - { name: at-least-two, match: { path: "/c" }, key: ip, algorithm: token_bucket, rate: 1/s, capacity: 1000, cost: 10, cost_from: { header: X-Cost, max: 100000 } }
  - { name: exact, match: { path: "/d" }, key: ip, algorithm: token_bucket, rate: 1/s, capacity: 1000, cost: 10, cost_from: { header: X-Cost, max: 10 } }
"#,
    )
    .with_slot_ttl(9_000_000);
    let cap = |i: usize| set.rules[i].cost_from.as_ref().unwrap().in_flight;
    for (i, n) in [(0, 7), (1, 20), (2, 2)] {
        let q = cap(i).unwrap();
        assert_eq!(q.algorithm, crate::limiter::Algorithm::Concurrency);
        assert_eq!((q.limit.get(), q.window_us.get()), (n, 9_000_000), "rule {i}");
    }
    assert_eq!(cap(3), None, "max = cost: nothing to debit, no cap");
}

/// A reported cost: the largest of every field line and list element, capped at `max` (also
/// when it does not fit 64 bits); `None` when an element is not a whole number.
#[test]
fn a_reported_cost_is_the_largest_value_capped_at_max() {
    let cf = CostFrom {
        source: super::CostSource::Header(http::HeaderName::from_static("x-cost")),
        max: 5000,
        in_flight: None,
        unit: None,
        missing_max: false,
    };
    let v = HeaderValue::from_static;
    assert_eq!(cf.parse(&v("7")), Some(7));
    assert_eq!(cf.parse(&v(" +42 ")), Some(42));
    assert_eq!(cf.parse(&v("99999999999999999999999")), Some(5000));
    assert_eq!(cf.parse(&v("5000, 1")), Some(5000));
    assert_eq!(cf.parse_all([&v("1"), &v("4000")]), Some(4000));
    for bad in ["", "abc", "-5", "0x10", "1e4", "4.5", "1, x", "+"] {
        assert_eq!(cf.parse(&v(bad)), None, "{bad:?}");
    }
}

/// Budgets on one rule: each limit spends its own way or the rule's, counts its own unit, and
/// an estimate leaves the in-flight cap to the rule's writer.
#[test]
fn limits_may_spend_their_own_way() {
    let set = rules(
        r#"
rules:
  - name: chat
    match: { path: "/v1/**" }
    key: user
    algorithm: fixed_window
    align: calendar
    limits:
      - { limit: 600, window: 1m }
      - { limit: 200000, window: 1m, cost: 1000, cost_from: { json: usage.prompt_tokens, max: 128000, in_flight: 100 } }
      - { limit: 50000, window: 1m, cost_from: { json: usage.completion_tokens, max: 16384 }, estimate: { json: [max_tokens, max_completion_tokens], default: 4096 } }
      - { limit: 20000000, window: 1mo, cost_from: { json: usage.total_tokens, max: 144384, unit: credits }, estimate: { json: max_tokens, default: 16384, within: 65536 } }
"#,
    );
    let r = &set.rules[0];
    assert_eq!(r.spend(0).cost, 1);
    assert!(r.spend(0).cost_from.is_none());
    assert_eq!(r.spend(0).slot, RULE_SPEND);
    assert_eq!((r.spend(1).cost, r.spend(1).slot), (1000, 1));
    assert_eq!(
        r.spend(2).cost,
        4096,
        "the estimate's default stands in before the body is read"
    );
    let e = r.spend(2).estimate.unwrap();
    assert_eq!(e.paths.len(), 2);
    assert_eq!(e.within, 1024 * 1024);
    assert_eq!(r.spend(3).estimate.unwrap().within, 65536);
    assert_eq!(
        r.spend(2).cost_from.unwrap().in_flight,
        None,
        "no default cap with an estimate"
    );
    assert_eq!(r.in_flight_cap().map(|q| q.limit.get()), Some(100));
    assert!(r.settles_cost() && r.estimates() && !r.lease);
    // Units: requests of cost, then tokens (the json default), then the unit named.
    assert_eq!(r.header_unit(0).name, None);
    assert_eq!(r.header_unit(1).name.as_deref(), Some("tokens"));
    assert_eq!(r.header_unit(3).name.as_deref(), Some("credits"));
    assert_eq!(r.header_unit(3).cost, 1);
    // Only the monthly window follows the calendar.
    assert!(r.limits[3].calendar.is_some() && r.limits[0].calendar.is_none());
}
