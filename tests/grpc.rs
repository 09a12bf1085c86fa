//! Issue #21 (part): what a gRPC client gets from tollgate itself. A limited gRPC call is HTTP
//! 200 with `grpc-status: 8` (RESOURCE_EXHAUSTED) and a `grpc-message` naming the rule and the
//! wait, the rate-limit headers kept as metadata; a fail-closed outage is `grpc-status: 14`
//! (UNAVAILABLE). Plain HTTP callers keep their 429 / 503. Real gateway, h2c client.

mod support;

use support::*;

fn h2c() -> reqwest::Client {
    reqwest::Client::builder().http2_prior_knowledge().build().unwrap()
}

async fn call(c: &reqwest::Client, url: &str) -> reqwest::Response {
    c.post(url)
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(vec![0u8, 0, 0, 0, 0])
        .send()
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limited_grpc_call_gets_resource_exhausted() {
    let up = echo().await;
    let rules = r#"rules:
  - { name: unary, match: { path: "/pkg.Service/Method" }, key: ip, algorithm: fixed_window, limit: 3, window: 1h }
"#;
    let gw = gateway(&format!("http://{up}"), "", rules, None).await;
    let c = h2c();
    let url = format!("{}/pkg.Service/Method", gw.url);
    for i in 0..3 {
        let r = call(&c, &url).await;
        assert_eq!(r.status(), 200, "call {i}");
        assert!(
            r.headers().get("grpc-status").is_none(),
            "an admitted call is the upstream's"
        );
    }
    let r = call(&c, &url).await;
    assert_eq!(r.status(), 200, "gRPC clients read grpc-status, not the HTTP status");
    assert_eq!(r.headers()["grpc-status"], "8");
    assert_eq!(r.headers()["content-type"], "application/grpc");
    let msg = r.headers()["grpc-message"].to_str().unwrap().to_owned();
    assert!(msg.contains("unary") && msg.contains("retry in"), "{msg}");
    assert!(
        r.headers().contains_key("ratelimit"),
        "rate-limit headers stay as metadata"
    );
    assert!(
        r.bytes().await.unwrap().is_empty(),
        "a trailers-only answer has no body"
    );
    // A plain HTTP caller of the same limit still gets 429.
    let plain = c.get(&url).send().await.unwrap();
    assert_eq!(plain.status(), 429);
    gw.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fail_closed_outage_is_unavailable_to_grpc() {
    let up = echo().await;
    let dead = free_port(); // nothing listens: the store is down from the start
    let rules = r#"rules:
  - { name: unary, match: { path: "/**" }, key: ip, algorithm: fixed_window, limit: 3, window: 1h, failure: closed }
"#;
    let store = format!("store:\n  kind: redis\n  urls: [\"redis://127.0.0.1:{dead}/\"]\n  timeout: 50ms\n");
    let gw = gateway(&format!("http://{up}"), &store, rules, None).await;
    let c = h2c();
    let r = call(&c, &format!("{}/pkg.Service/Method", gw.url)).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["grpc-status"], "14");
    let plain = c.get(format!("{}/x", gw.url)).send().await.unwrap();
    assert_eq!(plain.status(), 503);
    gw.stop().await;
}
