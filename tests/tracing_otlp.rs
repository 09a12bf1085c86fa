//! OTLP span export (`tracing.otlp`), end to end: the real binary, a real Redis, the echo
//! upstream, and a real OTLP/HTTP receiver that decodes what it gets with the PyPI package
//! `opentelemetry-proto` (tests/support/otlp_receiver.py).

mod support;

use std::time::Duration;

use support::*;

const RULES: &str = "rules:
  - { name: capped, match: { path: \"/limited/**\" }, key: global, algorithm: fixed_window, limit: 5, window: 1h }
  - { name: roomy, match: { path: \"/free/**\" }, key: global, algorithm: fixed_window, limit: 1000000000, window: 1h, failure: open }
  - { name: slowpoke, match: { path: \"/slow/**\" }, key: global, algorithm: fixed_window, limit: 1000000000, window: 1h }
";

/// The gateway file's store and tracing sections: Redis without leases (every check asks it),
/// spans to `endpoint` at `ratio`.
fn extra(redis: &str, endpoint: &str, ratio: f64) -> String {
    format!(
        "store:\n  kind: redis\n  urls: [\"{redis}\"]\n  timeout: 300ms\n  probe_interval: 100ms\n  leases: {{ enabled: false }}\nlimits:\n  deny_cache: false\ntracing:\n  otlp:\n    endpoint: {endpoint}\n    sample_ratio: {ratio}\n    service_name: tollgate-test\n    headers_env: {{ authorization: OTLP_TEST_AUTH }}\n"
    )
}

/// A `traceparent` for trace `i` of a test, with a parent id of its own.
fn traceparent(i: u32) -> (String, String, String) {
    let trace = format!("{:032x}", 0x4bf9_2f35_77b3_4da6_a3ce_0000_0000_0000u128 + u128::from(i));
    let parent = format!("{:016x}", 0x00f0_67aa_0000_0000u64 + u64::from(i));
    (format!("00-{trace}-{parent}-01"), trace, parent)
}

/// The request spans received (not tollgate's own background spans).
fn request_spans(rx: &OtlpReceiver) -> Vec<serde_json::Value> {
    rx.spans()
        .into_iter()
        .filter(|s| s["name"] != "tollgate.reload")
        .collect()
}

fn span_of<'a>(spans: &'a [serde_json::Value], trace: &str) -> Option<&'a serde_json::Value> {
    spans.iter().find(|s| s["trace_id"] == trace)
}

/// Sampled at ratio 1: an allowed request's span carries the incoming trace id, the incoming
/// parent as its parent, and as its own span id the parent the upstream was sent; its
/// attributes name the rule, decision, binding limit, fail-open, store latency and upstream
/// target. A request without `traceparent` starts a trace: a root span, and the upstream's
/// parent is that span (sampled flag set). A rules reload is exported as a span too.
#[tokio::test]
async fn spans_carry_the_trace_context_and_the_limit_attributes() {
    let redis = RedisServer::start();
    let rx = OtlpReceiver::start();
    let up = echo().await;
    let gw = binary_env(
        &format!("http://{up}"),
        &extra(&redis.url(), &rx.endpoint, 1.0),
        RULES,
        &[("OTLP_TEST_AUTH", "Bearer otlp-secret")],
    );
    let c = client();

    let (tp, trace, parent) = traceparent(1);
    let r = c
        .get(format!("{}/free/a?q=1", gw.url))
        .header("traceparent", &tp)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let echoed: serde_json::Value = r.json().await.unwrap();
    let sent = echoed["headers"]["traceparent"].as_str().unwrap().to_owned();
    let sent: Vec<&str> = sent.split('-').collect();
    assert_eq!(sent[1], trace);

    let spans = eventually_some(Duration::from_secs(10), || {
        let s = request_spans(&rx);
        let found = span_of(&s, &trace).is_some();
        async move { found.then_some(s) }
    })
    .await
    .unwrap_or_else(|| panic!("no span for {trace}: {:?}\n{}", rx.spans(), gw.log()));
    let s = span_of(&spans, &trace).unwrap();
    assert_eq!(s["parent_span_id"], parent.as_str(), "{s}");
    assert_eq!(s["span_id"], sent[2], "the upstream's parent is the exported span: {s}");
    assert_eq!(s["kind"], 2, "SPAN_KIND_SERVER: {s}");
    assert_eq!(s["name"], "GET");
    assert_eq!(s["service_name"], "tollgate-test");
    assert_eq!(
        s["authorization"], "Bearer otlp-secret",
        "headers_env is sent to the collector"
    );
    let a = &s["attributes"];
    assert_eq!(a["tollgate.rule"], "roomy", "{s}");
    assert_eq!(a["tollgate.decision"], "allowed");
    assert_eq!(a["tollgate.binding.limit"], 1_000_000_000);
    assert_eq!(a["tollgate.binding.window_ms"], 3_600_000);
    assert_eq!(a["tollgate.fail_open"], false);
    assert!(a["tollgate.store.latency_us"].as_i64().is_some_and(|us| us >= 0), "{s}");
    assert_eq!(a["tollgate.upstream.target"], format!("http://{up}"), "{s}");
    assert_eq!(a["http.response.status_code"], 200);
    assert_eq!(a["url.path"], "/free/a", "no query string: {s}");
    assert_eq!(a["tollgate.client_aborted"], false);
    let (start, end) = (s["start_ns"].as_u64().unwrap(), s["end_ns"].as_u64().unwrap());
    assert!(start > 1_600_000_000_000_000_000 && end >= start, "{s}");

    // A trace started at the gateway: a root span, sampled upstream.
    let echoed: serde_json::Value = c
        .get(format!("{}/free/b", gw.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let started = echoed["headers"]["traceparent"].as_str().unwrap().to_owned();
    let started: Vec<String> = started.split('-').map(str::to_owned).collect();
    assert_eq!(started[3], "01", "the ratio picked it: sampled upstream");
    let root = eventually_some(Duration::from_secs(10), || {
        let s = request_spans(&rx);
        let t = started[1].clone();
        async move { span_of(&s, &t).cloned() }
    })
    .await
    .unwrap_or_else(|| panic!("no span for the started trace: {:?}", rx.spans()));
    assert_eq!(root["parent_span_id"], "", "a started trace has no parent: {root}");
    assert_eq!(root["span_id"], started[2].as_str());

    // A reload: its `tracing` span goes out through tracing-opentelemetry.
    gw_rules(&gw, &RULES.replace("limit: 5,", "limit: 6,"));
    let reload = eventually_some(Duration::from_secs(15), || {
        let s = rx.spans();
        async move { s.into_iter().find(|s| s["name"] == "tollgate.reload") }
    })
    .await
    .unwrap_or_else(|| panic!("no reload span: {}", gw.log()));
    assert_eq!(reload["service_name"], "tollgate-test");
    let trigger = reload["attributes"]["trigger"].as_str().unwrap_or_default();
    assert!(["file change", "poll"].contains(&trigger), "{reload}");
    assert!(
        !gw.log().contains("otlp-secret"),
        "the header value never reaches the log"
    );
}

/// Rewrite the binary gateway's rules file (it reloads on change).
fn gw_rules(gw: &BinaryGateway, rules: &str) {
    atomic_write(&gw.config_dir().join("rules.yaml"), rules);
}

/// At ratio 0 no allowed request is exported, while every denial, every request that failed
/// open and a request whose client left (status 499, span status error, ended when it left)
/// is; the exported count is in `tollgate_otlp_spans_total`.
#[tokio::test]
async fn denials_and_fail_opens_are_always_exported_allowed_ones_follow_the_ratio() {
    let mut redis = RedisServer::start();
    let rx = OtlpReceiver::start();
    let up = echo().await;
    let gw = binary_env(
        &format!("http://{up}"),
        &extra(&redis.url(), &rx.endpoint, 0.0),
        RULES,
        &[("OTLP_TEST_AUTH", "Bearer x")],
    );
    let c = client();
    let send = |path: &'static str, i: u32| {
        let (tp, trace, parent) = traceparent(i);
        let r = c.get(format!("{}{path}", gw.url)).header("traceparent", tp);
        async move { (r.send().await.unwrap().status().as_u16(), trace, parent) }
    };
    let mut allowed = Vec::new();
    for i in 0..20 {
        let (status, trace, _) = send("/free/x", 100 + i).await;
        assert_eq!(status, 200);
        allowed.push(trace);
    }
    let mut denied = Vec::new();
    for i in 0..10 {
        let (status, trace, parent) = send("/limited/x", 200 + i).await;
        match status {
            200 => allowed.push(trace),
            429 => denied.push((trace, parent)),
            s => panic!("status {s}"),
        }
    }
    assert_eq!(denied.len(), 5, "the limit is 5");
    // A client that gives up before the (slow) upstream answers.
    let (tp, aborted, aborted_parent) = traceparent(400);
    let gave_up = c
        .get(format!("{}/slow/1500", gw.url))
        .header("traceparent", tp)
        .timeout(Duration::from_millis(200))
        .send()
        .await;
    assert!(gave_up.is_err(), "the client timed out");
    redis.kill();
    let mut failed_open = Vec::new();
    for i in 0..3 {
        let (status, trace, parent) = send("/free/y", 300 + i).await;
        assert_eq!(status, 200, "roomy fails open");
        failed_open.push((trace, parent));
    }

    let spans = eventually_some(Duration::from_secs(10), || {
        let s = request_spans(&rx);
        async move { (s.len() >= 9).then_some(s) }
    })
    .await
    .unwrap_or_else(|| panic!("spans: {:?}\n{}", request_spans(&rx), gw.log()));
    for (trace, parent) in &denied {
        let s = span_of(&spans, trace).unwrap_or_else(|| panic!("denial {trace} not exported: {spans:?}"));
        assert_eq!(s["parent_span_id"], parent.as_str());
        let a = &s["attributes"];
        assert_eq!(a["http.response.status_code"], 429, "{s}");
        assert_eq!(a["tollgate.decision"], "limited");
        assert_eq!(a["tollgate.rule"], "capped");
        assert_eq!(a["tollgate.binding.limit"], 5);
        assert_eq!(a["tollgate.binding.remaining"], 0);
        assert!(
            a.get("tollgate.upstream.target").is_none(),
            "a 429 never went upstream: {s}"
        );
    }
    for (trace, parent) in &failed_open {
        let s = span_of(&spans, trace).unwrap_or_else(|| panic!("fail-open {trace} not exported: {spans:?}"));
        assert_eq!(s["parent_span_id"], parent.as_str());
        let a = &s["attributes"];
        assert_eq!(a["tollgate.decision"], "fail_open", "{s}");
        assert_eq!(a["tollgate.fail_open"], true);
        assert_eq!(a["tollgate.rule"], "roomy");
        assert_eq!(a["tollgate.upstream.target"], format!("http://{up}"));
    }
    let s = span_of(&spans, &aborted).unwrap_or_else(|| panic!("aborted request not exported: {spans:?}"));
    assert_eq!(s["parent_span_id"], aborted_parent.as_str());
    assert_eq!(s["attributes"]["http.response.status_code"], 499, "{s}");
    assert_eq!(s["attributes"]["tollgate.decision"], "client_aborted");
    assert_eq!(s["attributes"]["tollgate.client_aborted"], true);
    assert_eq!(
        (s["status_code"].as_i64(), s["status_message"].as_str()),
        (Some(2), Some("client aborted")),
        "{s}"
    );
    let took_ms = (s["end_ns"].as_u64().unwrap() - s["start_ns"].as_u64().unwrap()) / 1_000_000;
    assert!(
        (150..1500).contains(&took_ms),
        "it ends when the client left: {took_ms} ms"
    );
    for trace in &allowed {
        assert!(span_of(&spans, trace).is_none(), "allowed {trace} exported at ratio 0");
    }
    assert_eq!(spans.len(), 9, "{spans:?}");
    // Counted once the collector has answered.
    let counted = eventually(Duration::from_secs(10), || {
        let (c, admin) = (c.clone(), gw.admin.clone());
        async move { metric_value(&c, &admin, "tollgate_otlp_spans_total{result=\"exported\"}").await == 9.0 }
    })
    .await;
    assert!(counted, "tollgate_otlp_spans_total{{result=\"exported\"}} is not 9");
}
