//! The Envoy rate-limit service (`tollgate rls`), end to end: the real binary on real Redis,
//! asked by a client that shares nothing with tollgate (Python grpcio, messages compiled from
//! Envoy's own `.proto` files). envoyproxy/ratelimit's README examples are replayed with their
//! configs as given, and the answers checked as that README describes them — except that a
//! request one descriptor denies spends nothing on the others (all or nothing).

mod support;

use std::process::Command;
use std::time::Duration;

use serde_json::{json, Value};
use support::*;

const EX1: &str = "domain: mongo_cps
descriptors:
  - key: database
    value: users
    rate_limit:
      unit: second
      requests_per_unit: 500

  - key: database
    value: default
    rate_limit:
      unit: second
      requests_per_unit: 500
";

const EX2: &str = "domain: messaging
descriptors:
  # Only allow 5 marketing messages a day
  - key: message_type
    value: marketing
    descriptors:
      - key: to_number
        rate_limit:
          unit: day
          requests_per_unit: 5

  # Only allow 100 messages a day to any unique phone number
  - key: to_number
    rate_limit:
      unit: day
      requests_per_unit: 100
";

const EX3: &str = "domain: edge_proxy_per_ip
descriptors:
  - key: remote_address
    rate_limit:
      unit: second
      requests_per_unit: 10

  # Black list IP
  - key: remote_address
    value: 50.0.0.5
    rate_limit:
      unit: second
      requests_per_unit: 0
";

const EX4_FLAT: &str = "domain: example4
descriptors:
  - key: key
    value: value
    rate_limit:
      requests_per_unit: 300
      unit: second
";

const EX4_NESTED: &str = "domain: example4
descriptors:
  - key: key
    value: value
    descriptors:
      - key: subkey
        rate_limit:
          requests_per_unit: 300
          unit: second
";

const EX5: &str = "domain: internal
descriptors:
  - key: ldap
    rate_limit:
      unlimited: true

  - key: azure
    rate_limit:
      unit: minute
      requests_per_unit: 100
";

const EX6: &str = "domain: example6
descriptors:
  - key: service
    descriptors:
      - key: user
        value: user-a
        rate_limit:
          requests_per_unit: 10
          unit: second
        shadow_mode: true
      - key: user
        value: user-b
        rate_limit:
          requests_per_unit: 20
          unit: second
";

const EX7: &str = "domain: example7
descriptors:
  - key: key_1
    value: value_1
    descriptors:
      - key: user
        value: bkthomps
        rate_limit:
          name: specific_limit
          requests_per_unit: 5
          unit: second
  - key: key_2
    value: value_2
    descriptors:
      - key: user
        value: bkthomps
        rate_limit:
          replaces:
            - name: specific_limit
          requests_per_unit: 10
          unit: second
";

const EX8: &str = "domain: example8
descriptors:
  - key: key1
    detailed_metric: true
    rate_limit:
      unit: minute
      requests_per_unit: 10
  - key: key1
    value: value1
    rate_limit:
      unit: minute
      requests_per_unit: 20
";

/// The README's three example9 configs (one domain, so one file here).
const EX9: &str = "domain: example9
descriptors:
  - key: key1
    value: value*
    rate_limit:
      unit: minute
      requests_per_unit: 20
  - key: path
    value: /api/*/action
    rate_limit:
      unit: minute
      requests_per_unit: 20
  - key: route
    value: /api/*/resource/*/action
    rate_limit:
      unit: minute
      requests_per_unit: 20
";

const EX10: &str = "domain: example10
descriptors:
  - key: route
    value_to_metric: true
    descriptors:
      - key: http_method
        value_to_metric: true
        descriptors:
          - key: subject_id
            rate_limit:
              unit: minute
              requests_per_unit: 60
";

const EX10_WILDCARD: &str = "domain: example10_wildcard
descriptors:
  - key: user
    value_to_metric: true
    descriptors:
      - key: action
        value: read*
        value_to_metric: true
        descriptors:
          - key: resource
            rate_limit:
              unit: minute
              requests_per_unit: 100
";

const EX11: &str = "domain: example11
descriptors:
  # With share_threshold: true, all files/* matches share the same threshold
  - key: files
    value: files/*
    share_threshold: true
    rate_limit:
      unit: hour
      requests_per_unit: 10

  # Without share_threshold, each files_no_share/* match has its own isolated threshold
  - key: files_no_share
    value: files_no_share/*
    share_threshold: false
    rate_limit:
      unit: hour
      requests_per_unit: 10
";

const EX11_METRICS: &str = "domain: example11_metrics
descriptors:
  - key: route
    value: api/*
    share_threshold: true
    value_to_metric: true
    descriptors:
      - key: method
        rate_limit:
          unit: minute
          requests_per_unit: 60
";

fn redis_store(r: &RedisServer, extra: &str) -> String {
    format!(
        "store:\n  kind: redis\n  urls: [\"{}\"]\n  timeout: 20ms\n  probe_interval: 100ms\n{extra}",
        r.url()
    )
}

fn examples() -> Vec<(&'static str, &'static str)> {
    vec![
        ("ex1.yaml", EX1),
        ("ex2.yaml", EX2),
        ("ex3.yaml", EX3),
        ("ex4.yaml", EX4_FLAT),
        ("ex5.yaml", EX5),
        ("ex6.yaml", EX6),
        ("ex7.yaml", EX7),
        ("ex8.yaml", EX8),
        ("ex9.yaml", EX9),
        ("ex10.yaml", EX10),
        ("ex10w.yaml", EX10_WILDCARD),
        ("ex11.yaml", EX11),
        ("ex11m.yaml", EX11_METRICS),
    ]
}

/// Status `i` of a call's answer.
fn st(r: &Value, i: usize) -> &Value {
    &r["statuses"][i]
}

/// Assert one status: code, current limit (`None`: none), limit_remaining.
fn expect(r: &Value, i: usize, code: &str, limit: Option<(u64, &str)>, remaining: u64) {
    let s = st(r, i);
    assert_eq!(s["code"], code, "status {i} of {r}");
    match limit {
        None => assert!(s["limit"].is_null(), "status {i} has no limit: {r}"),
        Some((rpu, unit)) => {
            assert_eq!(s["limit"]["rpu"], rpu, "status {i} of {r}");
            assert_eq!(s["limit"]["unit"], unit, "status {i} of {r}");
        }
    }
    assert_eq!(s["remaining"], remaining, "status {i} of {r}");
}

/// `duration_until_reset` of status `i` is in `1..=max` seconds.
fn expect_reset(r: &Value, i: usize, max: u64) {
    let d = st(r, i)["reset"]
        .as_u64()
        .unwrap_or_else(|| panic!("status {i} has no reset: {r}"));
    assert!((1..=max).contains(&d), "status {i} reset {d} not in 1..={max}: {r}");
}

#[test]
fn readme_examples_1_to_11_on_redis() {
    let redis = RedisServer::start();
    let node = rls_node(&redis_store(&redis, ""), "", &examples());
    let mut c = RlsClient::start();
    let a = node.addr.clone();

    // Example 1: two values of one key, 500/s each; another value matches nothing.
    let r = c.call(&a, "mongo_cps", &[&[("database", "users")]]);
    assert_eq!(r["overall"], "OK", "{r}");
    expect(&r, 0, "OK", Some((500, "SECOND")), 499);
    expect_reset(&r, 0, 1);
    let r = c.call(&a, "mongo_cps", &[&[("database", "other")]]);
    expect(&r, 0, "OK", None, 0);

    // Example 2: nested 5/day per number for marketing, plus 100/day per number; a request
    // over the first is denied and (all or nothing) spends nothing on the second.
    let both: [&[(&str, &str)]; 2] = [
        &[("message_type", "marketing"), ("to_number", "2061111111")],
        &[("to_number", "2061111111")],
    ];
    for n in 1..=5u64 {
        let r = c.call(&a, "messaging", &both);
        assert_eq!(r["overall"], "OK", "call {n}: {r}");
        expect(&r, 0, "OK", Some((5, "DAY")), 5 - n);
        expect(&r, 1, "OK", Some((100, "DAY")), 100 - n);
        expect_reset(&r, 0, 86_400);
    }
    let r = c.call(&a, "messaging", &both);
    assert_eq!(r["overall"], "OVER_LIMIT", "{r}");
    expect(&r, 0, "OVER_LIMIT", Some((5, "DAY")), 0);
    expect(&r, 1, "OK", Some((100, "DAY")), 95);
    let r = c.call(&a, "messaging", &[&[("to_number", "2061111111")]]);
    expect(&r, 0, "OK", Some((100, "DAY")), 94);
    // Another number has its own counters.
    let r = c.call(
        &a,
        "messaging",
        &[&[("message_type", "marketing"), ("to_number", "2062222222")]],
    );
    expect(&r, 0, "OK", Some((5, "DAY")), 4);

    // Example 3: the most specific match wins: 50.0.0.5 is blocked (0/s), others get 10/s.
    let r = c.call(&a, "edge_proxy_per_ip", &[&[("remote_address", "50.0.0.5")]]);
    assert_eq!(r["overall"], "OVER_LIMIT", "{r}");
    expect(&r, 0, "OVER_LIMIT", Some((0, "SECOND")), 0);
    let r = c.call(&a, "edge_proxy_per_ip", &[&[("remote_address", "50.0.0.1")]]);
    expect(&r, 0, "OK", Some((10, "SECOND")), 9);

    // Example 4 (first config): a two-entry descriptor does not match a one-level entry.
    let r = c.call(&a, "example4", &[&[("key", "value"), ("subkey", "subvalue")]]);
    expect(&r, 0, "OK", None, 0);
    let r = c.call(&a, "example4", &[&[("key", "value")]]);
    expect(&r, 0, "OK", Some((300, "SECOND")), 299);

    // Example 5: unlimited is OK with limit_remaining MaxUint32.
    let r = c.call(&a, "internal", &[&[("ldap", "x")], &[("azure", "y")]]);
    assert_eq!(r["overall"], "OK", "{r}");
    expect(&r, 0, "OK", None, u64::from(u32::MAX));
    expect(&r, 1, "OK", Some((100, "MINUTE")), 99);

    // Example 6: user-a is in shadow mode (never limited), user-b is limited at 20/s.
    start_of_second(Duration::from_millis(300));
    for n in 0..12 {
        let r = c.call(&a, "example6", &[&[("service", "auth-service"), ("user", "user-a")]]);
        assert_eq!(r["overall"], "OK", "user-a call {n}: {r}");
        assert_eq!(st(&r, 0)["code"], "OK", "{r}");
    }
    start_of_second(Duration::from_millis(300));
    let mut over = 0;
    for _ in 0..21 {
        let r = c.call(&a, "example6", &[&[("service", "auth-service"), ("user", "user-b")]]);
        if r["overall"] == "OVER_LIMIT" {
            over += 1;
            expect(&r, 0, "OVER_LIMIT", Some((20, "SECOND")), 0);
        }
    }
    assert_eq!(over, 1, "user-b: 20 of 21 calls in one second pass");

    // Example 7: with both descriptors, the replacing 10/s applies and the replaced 5/s limit
    // is not touched.
    start_of_second(Duration::from_millis(300));
    let k1: &[(&str, &str)] = &[("key_1", "value_1"), ("user", "bkthomps")];
    let k2: &[(&str, &str)] = &[("key_2", "value_2"), ("user", "bkthomps")];
    let r = c.call(&a, "example7", &[k1, k2]);
    assert_eq!(r["overall"], "OK", "{r}");
    expect(&r, 0, "OK", None, 0);
    expect(&r, 1, "OK", Some((10, "SECOND")), 9);
    let r = c.call(&a, "example7", &[k1]);
    expect(&r, 0, "OK", Some((5, "SECOND")), 4);

    // Example 8: a key without a value matches any value (10/min); the listed value 20/min.
    let r = c.call(&a, "example8", &[&[("key1", "unspecified_value")]]);
    expect(&r, 0, "OK", Some((10, "MINUTE")), 9);
    expect_reset(&r, 0, 60);
    let r = c.call(&a, "example8", &[&[("key1", "value1")]]);
    expect(&r, 0, "OK", Some((20, "MINUTE")), 19);

    // Example 9: trailing, middle and multiple wildcards; each value its own counter.
    let r = c.call(
        &a,
        "example9",
        &[&[("key1", "value1")], &[("key1", "valueXYZ")], &[("key1", "other")]],
    );
    expect(&r, 0, "OK", Some((20, "MINUTE")), 19);
    expect(&r, 1, "OK", Some((20, "MINUTE")), 19);
    expect(&r, 2, "OK", None, 0);
    let r = c.call(
        &a,
        "example9",
        &[&[("path", "/api/123/action")], &[("path", "/api/123/other")]],
    );
    expect(&r, 0, "OK", Some((20, "MINUTE")), 19);
    expect(&r, 1, "OK", None, 0);
    let r = c.call(
        &a,
        "example9",
        &[
            &[("route", "/api/v1/resource/123/action")],
            &[("route", "/api/v1/other/123/action")],
        ],
    );
    expect(&r, 0, "OK", Some((20, "MINUTE")), 19);
    expect(&r, 1, "OK", None, 0);

    // Example 10: value_to_metric changes metrics only; the limits match as usual.
    let r = c.call(
        &a,
        "example10",
        &[&[("route", "api"), ("http_method", "GET"), ("subject_id", "123")]],
    );
    expect(&r, 0, "OK", Some((60, "MINUTE")), 59);
    let r = c.call(
        &a,
        "example10_wildcard",
        &[&[("user", "alice"), ("action", "readfile"), ("resource", "documents")]],
    );
    expect(&r, 0, "OK", Some((100, "MINUTE")), 99);
    let r = c.call(
        &a,
        "example10_wildcard",
        &[&[("user", "alice"), ("action", "write"), ("resource", "documents")]],
    );
    expect(&r, 0, "OK", None, 0);
    // The metric names envoyproxy/ratelimit's README gives for example 10: the runtime values
    // of the value_to_metric entries (a wildcard's whole value), the key alone elsewhere.
    let m = node.metrics();
    for name in [
        "example10.route_api.http_method_GET.subject_id",
        "example10_wildcard.user_alice.action_readfile.resource",
    ] {
        let domain = name.split('.').next().unwrap_or_default();
        let line = format!(
            "tollgate_rls_limit_descriptors_total{{domain=\"{domain}\",descriptor=\"{name}\",outcome=\"within_limit\"}}"
        );
        assert_eq!(metric(&m, &line).as_deref(), Some("1"), "{line} in\n{m}");
    }

    // Example 11: files/* share one threshold; files_no_share/* each have their own.
    for _ in 0..5 {
        assert_eq!(c.call(&a, "example11", &[&[("files", "files/a.pdf")]])["overall"], "OK");
        assert_eq!(c.call(&a, "example11", &[&[("files", "files/b.csv")]])["overall"], "OK");
    }
    let r = c.call(&a, "example11", &[&[("files", "files/c.txt")]]);
    assert_eq!(r["overall"], "OVER_LIMIT", "{r}");
    expect(&r, 0, "OVER_LIMIT", Some((10, "HOUR")), 0);
    expect_reset(&r, 0, 3600);
    for n in 0..10 {
        let r = c.call(&a, "example11", &[&[("files_no_share", "files_no_share/a.pdf")]]);
        assert_eq!(r["overall"], "OK", "call {n}: {r}");
    }
    let r = c.call(&a, "example11", &[&[("files_no_share", "files_no_share/a.pdf")]]);
    assert_eq!(r["overall"], "OVER_LIMIT", "{r}");
    let r = c.call(&a, "example11", &[&[("files_no_share", "files_no_share/b.csv")]]);
    expect(&r, 0, "OK", Some((10, "HOUR")), 9);
    let r = c.call(&a, "example11_metrics", &[&[("route", "api/v1"), ("method", "GET")]]);
    expect(&r, 0, "OK", Some((60, "MINUTE")), 59);
    let r = c.call(&a, "example11_metrics", &[&[("route", "api/v2"), ("method", "GET")]]);
    expect(&r, 0, "OK", Some((60, "MINUTE")), 58);

    // Example 4 (second config), by a reload: now the two-entry descriptor matches.
    node.write_domain("ex4.yaml", EX4_NESTED);
    let matched = eventually_blocking(Duration::from_secs(1), || {
        let r = c.call(&a, "example4", &[&[("key", "value"), ("subkey", "subvalue")]]);
        st(&r, 0)["limit"]["rpu"] == 300
    });
    assert!(matched, "the edited file was in force within 1 s: {}", node.gw.log());
    let r = c.call(&a, "example4", &[&[("key", "value")]]);
    expect(&r, 0, "OK", None, 0);

    // Store keys carry a keyed hash, never a descriptor value.
    let keys = redis.cli(&["KEYS", "*"]);
    assert!(!keys.is_empty());
    for needle in ["2061111111", "users", "bkthomps", "files", "mongo"] {
        assert!(!keys.contains(needle), "a descriptor value reached Redis: {keys}");
    }
}

#[test]
fn hits_addend_per_request_and_per_descriptor_and_zero_peeks() {
    let redis = RedisServer::start();
    let node = rls_node(&redis_store(&redis, ""), "", &[("ex2.yaml", EX2)]);
    let mut c = RlsClient::start();
    let one = json!([{"entries": [["to_number", "1"]]}]);
    let call = |c: &mut RlsClient, hits: u64, desc: Value| {
        c.send(json!({"op": "call", "addr": node.addr, "domain": "messaging", "hits": hits, "descriptors": desc}))
    };
    let r = call(&mut c, 7, one.clone());
    expect(&r, 0, "OK", Some((100, "DAY")), 93);
    // A descriptor's own hits_addend wins over the request's; 0 peeks.
    let r = call(&mut c, 7, json!([{"entries": [["to_number", "1"]], "hits": 0}]));
    expect(&r, 0, "OK", Some((100, "DAY")), 93);
    let r = call(&mut c, 7, json!([{"entries": [["to_number", "1"]], "hits": 3}]));
    expect(&r, 0, "OK", Some((100, "DAY")), 90);
    // Unset (0) at the request level is 1.
    let r = call(&mut c, 0, one.clone());
    expect(&r, 0, "OK", Some((100, "DAY")), 89);
    // More than is left is over the limit and spends nothing.
    let r = call(&mut c, 90, one.clone());
    assert_eq!(r["overall"], "OVER_LIMIT", "{r}");
    let r = call(&mut c, 0, json!([{"entries": [["to_number", "1"]], "hits": 0}]));
    expect(&r, 0, "OK", Some((100, "DAY")), 89);
    // The same counter twice in one request counts twice, and both see the sum.
    let r = call(
        &mut c,
        1,
        json!([{"entries": [["to_number", "1"]]}, {"entries": [["to_number", "1"]]}]),
    );
    expect(&r, 0, "OK", Some((100, "DAY")), 87);
    expect(&r, 1, "OK", Some((100, "DAY")), 87);
    // Envoy's per-descriptor `limit` override replaces the configured limit (a fixed window).
    let over = json!([{"entries": [["to_number", "2"]], "limit": [2, "MINUTE"]}]);
    let r = call(&mut c, 0, over.clone());
    expect(&r, 0, "OK", Some((2, "MINUTE")), 1);
    expect_reset(&r, 0, 60);
    assert_eq!(call(&mut c, 0, over.clone())["overall"], "OK");
    let r = call(&mut c, 0, over);
    assert_eq!(r["overall"], "OVER_LIMIT", "{r}");
    expect(&r, 0, "OVER_LIMIT", Some((2, "MINUTE")), 0);
}

#[test]
fn bad_input_gets_a_grpc_error_and_moves_no_counter() {
    let redis = RedisServer::start();
    let mut node = rls_node(&redis_store(&redis, ""), "", &[("ex2.yaml", EX2)]);
    let mut c = RlsClient::start();
    let a = node.addr.clone();
    let r = c.call(&a, "messaging", &[&[("to_number", "9")]]);
    expect(&r, 0, "OK", Some((100, "DAY")), 99);
    let before = redis.cli(&["DBSIZE"]);
    let bad = |c: &mut RlsClient, cmd: Value, what: &str| {
        let r = c.send(cmd);
        assert!(r.get("error").is_some(), "{what}: an error status, got {r}");
        r
    };
    let r = bad(
        &mut c,
        json!({"op": "call", "addr": a, "domain": "", "descriptors": [{"entries": [["to_number", "9"]]}]}),
        "empty domain",
    );
    assert_eq!(r["error"], "INVALID_ARGUMENT", "{r}");
    let r = bad(
        &mut c,
        json!({"op": "call", "addr": a, "domain": "messaging", "descriptors": []}),
        "no descriptors",
    );
    assert_eq!(r["error"], "INVALID_ARGUMENT", "{r}");
    let r = bad(
        &mut c,
        json!({"op": "call", "addr": a, "domain": "messaging", "descriptors": [{"entries": [["to_number", "9"]], "hits": u64::MAX}]}),
        "huge per-descriptor hits_addend",
    );
    assert_eq!(r["error"], "INVALID_ARGUMENT", "{r}");
    let r = bad(
        &mut c,
        json!({"op": "call", "addr": a, "domain": "messaging", "hits": u32::MAX, "descriptors": [{"entries": [["to_number", "9"]]}]}),
        "huge request hits_addend",
    );
    assert_eq!(r["error"], "INVALID_ARGUMENT", "{r}");
    let many: Vec<Value> = (0..1000)
        .map(|i| json!({"entries": [["to_number", i.to_string()]]}))
        .collect();
    let r = bad(
        &mut c,
        json!({"op": "call", "addr": a, "domain": "messaging", "descriptors": many}),
        "1000 descriptors",
    );
    assert_eq!(r["error"], "INVALID_ARGUMENT", "{r}");
    // Not a protobuf message at all, and a message cut short.
    let r = bad(
        &mut c,
        json!({"op": "raw", "addr": a, "hex": "ffffffffffffffffffff"}),
        "garbage frame",
    );
    assert_ne!(r["error"], "OK");
    let r = bad(
        &mut c,
        json!({"op": "raw", "addr": a, "hex": "0a0f6d657373"}),
        "truncated message",
    );
    assert_ne!(r["error"], "OK");
    // One counter named with two limits (the configured one and an override) in one request:
    // each would have compared the count before the other's hits (hostile-client case).
    let r = bad(
        &mut c,
        json!({"op": "call", "addr": a, "domain": "messaging", "descriptors": [
            {"entries": [["to_number", "9"]], "hits": 50},
            {"entries": [["to_number", "9"]], "hits": 50, "limit": [1000, "DAY"]},
        ]}),
        "one counter, two limits",
    );
    assert_eq!(r["error"], "INVALID_ARGUMENT", "{r}");
    // An override whose unit is unknown: refused, never "no limit" (hostile-client case).
    let r = bad(
        &mut c,
        json!({"op": "call", "addr": a, "domain": "messaging", "descriptors": [{"entries": [["to_number", "9"]], "limit": [1, "UNKNOWN"]}]}),
        "override with an unknown unit",
    );
    assert_eq!(r["error"], "INVALID_ARGUMENT", "{r}");
    // Still serving, and no counter moved.
    let r = c.call(&a, "messaging", &[&[("to_number", "9")]]);
    expect(&r, 0, "OK", Some((100, "DAY")), 98);
    assert_eq!(redis.cli(&["DBSIZE"]), before, "bad input made no store key");
    assert!(
        matches!(node.gw.child.try_wait(), Ok(None)),
        "the service is still running"
    );
}

#[test]
fn redis_killed_answers_fast_with_each_failure_policy() {
    let mut redis = RedisServer::start();
    let domain = "domain: failing
descriptors:
  - key: open
    rate_limit: { unit: minute, requests_per_unit: 1000 }
  - key: closed
    failure: closed
    rate_limit: { unit: minute, requests_per_unit: 1000 }
";
    let node = rls_node(&redis_store(&redis, ""), "", &[("f.yaml", domain)]);
    let mut c = RlsClient::start();
    let a = node.addr.clone();
    let r = c.call(&a, "failing", &[&[("open", "x")], &[("closed", "x")]]);
    assert_eq!(r["overall"], "OK", "{r}");
    redis.kill();
    let open = c.send(json!({"op": "repeat", "addr": a, "n": 300, "domain": "failing", "descriptors": [{"entries": [["open", "x"]]}]}));
    eprintln!("Redis killed, fail open: {open}");
    assert_eq!(open["ok"], 300, "fail open (the default): every call OK: {open}");
    assert!(
        open["p99_ms"].as_f64().unwrap_or(f64::MAX) < 25.0,
        "p99 under 25 ms with Redis down: {open}"
    );
    let closed = c.send(json!({"op": "repeat", "addr": a, "n": 300, "domain": "failing", "descriptors": [{"entries": [["closed", "x"]]}]}));
    eprintln!("Redis killed, fail closed: {closed}");
    assert_eq!(closed["over"], 300, "fail closed: every call OVER_LIMIT: {closed}");
    assert!(
        closed["p99_ms"].as_f64().unwrap_or(f64::MAX) < 25.0,
        "p99 under 25 ms with Redis down: {closed}"
    );
}

/// Three `tollgate rls` instances on `store`, 100 calls each from three clients at once, per
/// algorithm: exactly the limit (150) is admitted. Leases off: with them a fleet may admit
/// less than the limit while a lease is out (never more).
fn fleet_admits_exactly_the_limit(store: &str) {
    let domain = "domain: fleet
descriptors:
  - key: tenant
    rate_limit: { unit: hour, requests_per_unit: 150 }
  - key: sliding
    rate_limit: { unit: hour, requests_per_unit: 150, algorithm: sliding_window }
  - key: bucket
    rate_limit: { unit: hour, requests_per_unit: 150, algorithm: token_bucket }
";
    let nodes: Vec<RlsNode> = (0..3).map(|_| rls_node(store, "", &[("fleet.yaml", domain)])).collect();
    for key in ["tenant", "sliding", "bucket"] {
        let handles: Vec<_> = nodes
            .iter()
            .map(|n| {
                let addr = n.addr.clone();
                std::thread::spawn(move || {
                    let mut c = RlsClient::start();
                    c.send(json!({"op": "repeat", "addr": addr, "n": 100, "domain": "fleet", "descriptors": [{"entries": [[key, "acme"]]}]}))
                })
            })
            .collect();
        let results: Vec<Value> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        let ok: u64 = results.iter().map(|r| r["ok"].as_u64().unwrap_or(0)).sum();
        let errors: u64 = results.iter().map(|r| r["errors"].as_u64().unwrap_or(0)).sum();
        assert_eq!(errors, 0, "{key}: {results:?}");
        assert_eq!(ok, 150, "{key}: three instances admit exactly the limit: {results:?}");
    }
}

#[test]
fn three_instances_on_one_redis_admit_exactly_the_limit() {
    let redis = RedisServer::start();
    fleet_admits_exactly_the_limit(&redis_store(&redis, "  leases:\n    enabled: false\n"));
}

#[test]
fn three_instances_on_a_redis_cluster_admit_exactly_the_limit() {
    let cluster = RedisCluster::start();
    let urls: Vec<String> = cluster.seed_urls().iter().map(|u| format!("\"{u}\"")).collect();
    let store = format!(
        "store:\n  kind: redis_cluster\n  urls: [{}]\n  timeout: 50ms\n  probe_interval: 100ms\n  leases:\n    enabled: false\n",
        urls.join(", ")
    );
    fleet_admits_exactly_the_limit(&store);
}

#[test]
fn a_broken_file_keeps_the_config_and_check_names_its_line() {
    let redis = RedisServer::start();
    let node = rls_node(&redis_store(&redis, ""), "", &[("ex5.yaml", EX5)]);
    let mut c = RlsClient::start();
    let a = node.addr.clone();
    let r = c.call(&a, "internal", &[&[("azure", "y")]]);
    expect(&r, 0, "OK", Some((100, "MINUTE")), 99);
    node.write_domain("ex5.yaml", "domain: internal\ndescriptors:\n  - key: azure\n    rate_limit:\n      unit: fortnight\n      requests_per_unit: 3\n");
    let refused = eventually_blocking(Duration::from_secs(2), || {
        node.gw.log().contains("rls config reload refused")
    });
    assert!(refused, "the broken file was refused: {}", node.gw.log());
    let r = c.call(&a, "internal", &[&[("azure", "y")]]);
    expect(&r, 0, "OK", Some((100, "MINUTE")), 98);
    let (ok, text) = tollgate_check(&node.gateway_file);
    assert!(!ok, "check refuses the broken file: {text}");
    assert!(text.contains("ex5.yaml:5:13"), "check names file:line:col: {text}");
    assert!(text.contains("fortnight"), "{text}");
    // A fixed file (and a new domain in a new file) are in force within a second.
    node.write_domain("ex5.yaml", EX5.replace("100", "7").as_str());
    node.write_domain("ex1.yaml", EX1);
    let fixed = eventually_blocking(Duration::from_secs(1), || {
        let r = c.call(&a, "internal", &[&[("azure", "y")]]);
        st(&r, 0)["limit"]["rpu"] == 7
    });
    assert!(fixed, "the fixed file is in force within 1 s");
    let r = c.call(&a, "mongo_cps", &[&[("database", "users")]]);
    expect(&r, 0, "OK", Some((500, "SECOND")), 499);
    let (ok, text) = tollgate_check(&node.gateway_file);
    assert!(ok, "{text}");
    assert!(text.contains("domain mongo_cps"), "{text}");
}

#[test]
fn json_healthcheck_and_grpc_health() {
    let node = rls_node("", "  headers: x-ratelimit\n", &[("ex2.yaml", EX2)]);
    let mut c = RlsClient::start();
    let h = c.send(json!({"op": "health", "addr": node.addr, "service": ""}));
    assert_eq!(h["status"], "SERVING", "{h}");
    let h =
        c.send(json!({"op": "health", "addr": node.addr, "service": "envoy.service.ratelimit.v3.RateLimitService"}));
    assert_eq!(h["status"], "SERVING", "{h}");
    let r = c.call(&node.addr, "messaging", &[&[("to_number", "5")]]);
    assert_eq!(
        r["headers"],
        json!([
            ["X-RateLimit-Limit", "100"],
            ["X-RateLimit-Remaining", "99"],
            ["X-RateLimit-Reset", st(&r, 0)["reset"].to_string()]
        ]),
        "{r}"
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let http = client();
        let base = format!("http://{}", node.addr);
        let hc = http.get(format!("{base}/healthcheck")).send().await.unwrap();
        assert_eq!(hc.status(), 200);
        let body = json!({"domain": "messaging", "descriptors": [{"entries": [{"key": "to_number", "value": "5"}]}], "hitsAddend": 98});
        let resp = http.post(format!("{base}/json")).json(&body).send().await.unwrap();
        assert_eq!(resp.status(), 200);
        let v: Value = resp.json().await.unwrap();
        assert_eq!(v["overallCode"], "OK", "{v}");
        assert_eq!(v["statuses"][0]["currentLimit"]["requestsPerUnit"], 100, "{v}");
        assert_eq!(v["statuses"][0]["currentLimit"]["unit"], "DAY", "{v}");
        assert_eq!(v["statuses"][0]["limitRemaining"], 1, "{v}");
        let resp = http.post(format!("{base}/json")).json(&body).send().await.unwrap();
        assert_eq!(resp.status(), 429);
        let v: Value = resp.json().await.unwrap();
        assert_eq!(v["overallCode"], "OVER_LIMIT", "{v}");
        let resp = http.post(format!("{base}/json")).body("{not json").send().await.unwrap();
        assert_eq!(resp.status(), 400);
    });
}

#[test]
fn ietf_headers_name_the_binding_limit_and_its_window() {
    let node = rls_node("", "  headers: ietf\n", &[("ex2.yaml", EX2)]);
    let mut c = RlsClient::start();
    let r = c.call(&node.addr, "messaging", &[&[("to_number", "5")]]);
    let reset = st(&r, 0)["reset"].as_u64().unwrap();
    assert!(reset > 0 && reset <= 86_400, "{r}");
    assert_eq!(
        r["headers"],
        json!([
            ["RateLimit-Policy", "\"rls\";q=100;w=86400"],
            ["RateLimit", format!("\"rls\";r=99;t={reset}")]
        ]),
        "{r}"
    );
}

#[test]
fn run_serves_the_proxy_and_the_rate_limit_service_in_one_process() {
    let cfg = tempfile::tempdir().unwrap();
    std::fs::write(cfg.path().join("ex5.yaml"), EX5).unwrap();
    let rls_port = free_port();
    let extra = format!(
        "rls:\n  listen: 127.0.0.1:{rls_port}\n  config_dir: {}\n",
        cfg.path().display()
    );
    let gw = binary("http://127.0.0.1:9", &extra, OPEN_RULES);
    let mut c = RlsClient::start();
    let addr = format!("127.0.0.1:{rls_port}");
    let up = eventually_blocking(Duration::from_secs(5), || {
        c.call(&addr, "internal", &[&[("azure", "y")]]).get("overall").is_some()
    });
    assert!(up, "the rate-limit service answers beside the proxy: {}", gw.log());
    let r = c.call(&addr, "internal", &[&[("azure", "y")]]);
    expect(&r, 0, "OK", Some((100, "MINUTE")), 98);
    assert!(gw.log().contains("envoy rate-limit service listening"), "{}", gw.log());
}

#[test]
fn sigterm_drains_health_not_serving_while_calls_are_answered() {
    let mut node = rls_node("server:\n  drain: 3s\n", "", &[("ex5.yaml", EX5)]);
    let mut c = RlsClient::start();
    let a = node.addr.clone();
    assert_eq!(
        c.send(json!({"op": "health", "addr": a, "service": ""}))["status"],
        "SERVING"
    );
    let pid = node.gw.child.id().to_string();
    assert!(std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let not_serving = eventually_blocking(Duration::from_secs(2), || {
        c.send(json!({"op": "health", "addr": a, "service": "envoy.service.ratelimit.v3.RateLimitService"}))["status"]
            == "NOT_SERVING"
    });
    assert!(
        not_serving,
        "health says NOT_SERVING in the drain window: {}",
        node.gw.log()
    );
    let r = c.call(&a, "internal", &[&[("azure", "y")]]);
    assert_eq!(r["overall"], "OK", "calls are still answered while draining: {r}");
    let exited = eventually_blocking(Duration::from_secs(10), || {
        matches!(node.gw.child.try_wait(), Ok(Some(_)))
    });
    assert!(exited, "it exits after the drain: {}", node.gw.log());
    assert!(
        node.gw.child.try_wait().unwrap().unwrap().success(),
        "{}",
        node.gw.log()
    );
}

#[test]
fn across_a_window_boundary_a_fixed_window_lets_twice_through_and_a_sliding_log_never_does() {
    let redis = RedisServer::start();
    let domain = "domain: boundary
descriptors:
  - key: fixed
    rate_limit: { unit: second, requests_per_unit: 10 }
  - key: sliding_log
    rate_limit: { unit: second, requests_per_unit: 10, algorithm: sliding_log }
  - key: sliding_window
    rate_limit: { unit: second, requests_per_unit: 10, algorithm: sliding_window }
";
    let node = rls_node(
        &redis_store(&redis, "  leases:\n    enabled: false\n"),
        "",
        &[("b.yaml", domain)],
    );
    let mut c = RlsClient::start();
    let burst = |c: &mut RlsClient, key: &str| {
        let r = c.send(json!({"op": "repeat", "addr": node.addr, "n": 10, "domain": "boundary", "descriptors": [{"entries": [[key, "k"]]}]}));
        assert_eq!(r["errors"], 0, "{r}");
        r["ok"].as_u64().unwrap_or(0)
    };
    for key in ["fixed", "sliding_log", "sliding_window"] {
        // Ten late in one second, ten early in the next: all twenty within one second.
        let s = within_second(Duration::from_millis(600), Duration::from_millis(750));
        let first = burst(&mut c, key);
        let s2 = within_second(Duration::ZERO, Duration::from_millis(150));
        assert_eq!(s2, s + 1, "{key}: the second burst is in the next second");
        let second = burst(&mut c, key);
        let spent = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64()
            - s as f64;
        assert!(
            spent < 1.6,
            "{key}: both bursts within one window-long span ({spent:.3} s after the first began)"
        );
        assert_eq!(first, 10, "{key}: the first burst fits");
        match key {
            "fixed" => assert_eq!(
                second, 10,
                "a fixed window lets a second full burst through at the boundary"
            ),
            "sliding_log" => assert_eq!(second, 0, "a sliding log admits no more than the limit in any second"),
            _ => assert!(
                second <= 1,
                "a sliding window admits at most about the limit in any second: {second}"
            ),
        }
    }
}

/// A gateway file for the rate-limit service alone needs neither an upstream nor rules:
/// `tollgate rls` serves it, `tollgate check` accepts it, and `tollgate run` (the proxy)
/// refuses it, saying why.
#[test]
fn a_file_without_upstream_or_rules_runs_the_rate_limit_service_alone() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("config")).unwrap();
    std::fs::write(dir.path().join("config").join("ex2.yaml"), EX2).unwrap();
    let (port, admin_port) = (free_port(), free_port());
    let file = dir.path().join("gateway.yaml");
    std::fs::write(
        &file,
        format!("admin_listen: 127.0.0.1:{admin_port}\nrls:\n  listen: 127.0.0.1:{port}\n  config_dir: config\n"),
    )
    .unwrap();
    let (ok, out) = tollgate_check(&file);
    assert!(ok, "check accepts it: {out}");
    let run = Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["run", "--config"])
        .arg(&file)
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&run.stderr).to_string() + &String::from_utf8_lossy(&run.stdout);
    assert!(!run.status.success(), "run has no proxy to serve: {said}");
    assert!(said.contains("no `upstream:`"), "{said}");
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tollgate"));
    cmd.args(["rls", "--config"]).arg(&file);
    let _gw = BinaryGateway::spawn(&mut cmd, dir.path().join("tollgate.log"), &[port, admin_port]);
    let mut c = RlsClient::start();
    let addr = format!("127.0.0.1:{port}");
    let r = c.call(&addr, "messaging", &[&[("to_number", "5")]]);
    assert_eq!(r["overall"], "OK", "{r}");
    expect(&r, 0, "OK", Some((100, "DAY")), 99);
}

/// Malformed gRPC framing, sent with a raw HTTP/2 client (the `h2` crate, not tollgate's gRPC
/// stack): a length prefix longer than the body, a compressed flag with no `grpc-encoding`, a
/// message over the size limit, and two messages in a unary call. Each gets a gRPC error
/// status, the process stays up, and no counter moves.
#[test]
fn malformed_grpc_frames_get_an_error_status_and_move_no_counter() {
    let node = rls_node("", "", &[("ex2.yaml", EX2)]);
    let mut c = RlsClient::start();
    let r = c.call(&node.addr, "messaging", &[&[("to_number", "7")]]);
    expect(&r, 0, "OK", Some((100, "DAY")), 99);
    // A well-formed RateLimitRequest for the same descriptor: domain "messaging", one
    // descriptor with the entry to_number=7 (protobuf by hand: field 1 string, field 2 message
    // of field 1 message of fields 1 and 2 strings).
    let entry = [&[0x0a, 9][..], b"to_number", &[0x12, 1], b"7"].concat();
    let descriptor = [&[0x0a, entry.len() as u8][..], &entry].concat();
    let msg = [
        &[0x0a, 9][..],
        b"messaging",
        &[0x12, descriptor.len() as u8],
        &descriptor,
    ]
    .concat();
    let frame = |flag: u8, declared: u32, body: &[u8]| [&[flag][..], &declared.to_be_bytes(), body].concat();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("a length prefix longer than the body", frame(0, 1000, &msg)),
        ("compressed with no grpc-encoding", frame(1, msg.len() as u32, &msg)),
        ("a message over the size limit", frame(0, 64 << 20, &msg)),
        (
            "two messages in a unary call",
            [frame(0, msg.len() as u32, &msg), frame(0, msg.len() as u32, &msg)].concat(),
        ),
    ];
    // The last case is decided on its first message alone (as tonic reads a unary call) and
    // counted once: it is not refused, and it is not a second call for free either.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    for (n, (what, body)) in cases.into_iter().enumerate() {
        let status = rt.block_on(async {
            let s = tokio::net::TcpStream::connect(&node.addr).await.unwrap();
            let (h2, conn) = h2::client::handshake(s).await.unwrap();
            let conn = tokio::spawn(conn);
            let mut h2 = h2.ready().await.unwrap();
            let req = http::Request::post(format!(
                "http://{}/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
                node.addr
            ))
            .header("content-type", "application/grpc")
            .header("te", "trailers")
            .body(())
            .unwrap();
            let (resp, mut send) = h2.send_request(req, false).unwrap();
            send.send_data(bytes::Bytes::from(body), true).unwrap();
            let resp = tokio::time::timeout(Duration::from_secs(5), resp)
                .await
                .unwrap()
                .unwrap();
            let mut status = resp
                .headers()
                .get("grpc-status")
                .map(|v| v.to_str().unwrap().to_string());
            let mut body = resp.into_body();
            while let Some(chunk) = body.data().await {
                if chunk.is_err() {
                    break;
                }
            }
            if status.is_none() {
                if let Ok(Some(t)) = body.trailers().await {
                    status = t.get("grpc-status").map(|v| v.to_str().unwrap().to_string());
                }
            }
            drop(h2);
            conn.abort();
            status
        });
        let status = status.unwrap_or_else(|| panic!("{what}: no grpc-status"));
        if n < 3 {
            assert_ne!(status, "0", "{what}: answered OK");
        } else {
            assert_eq!(status, "0", "{what}");
        }
    }
    // Still up, and the counter is where the good call and the two-message call left it.
    let r = c.call(&node.addr, "messaging", &[&[("to_number", "7")]]);
    expect(&r, 0, "OK", Some((100, "DAY")), 97);
}
