//! What a gRPC client gets from tollgate itself. A limited gRPC call is HTTP
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

// --- Real gRPC peers: grpcio's own server and client (tests/fixtures/grpc), the real binary ---

/// One rule that never limits.
const OPEN: &str = "rules:\n  - { name: open, match: { path: \"/**\" }, key: global, algorithm: fixed_window, limit: 1000000000, window: 1h }\n";

#[test]
fn unary_streaming_and_bidi_calls_pass_an_h2c_upstream_with_metadata_and_trailers() {
    let server = GrpcServer::start(&[]);
    let (gw, _dir) = grpc_gateway(&format!("http://{}", server.addr()), "h2c", OPEN, "");
    let addr = gw.url.trim_start_matches("http://").to_owned();

    let r = grpc_client(&["unary", &addr]);
    assert_eq!(r["code"], "OK", "{r}");
    assert_eq!(r["reply"], "ping");
    assert_eq!(r["initial"]["x-initial"], "hello", "initial metadata: {r}");
    assert_eq!(
        r["initial"]["x-echo-client"], "tollgate-test",
        "the caller's metadata reached the server: {r}"
    );
    assert_eq!(r["trailing"]["x-trailer"], "bye", "trailing metadata: {r}");
    assert_eq!(r["trailing"]["x-echo-client"], "tollgate-test");

    // The server's own error status and message are the client's (a trailers-only answer).
    let r = grpc_client(&["unary", &addr, "fail"]);
    assert_eq!(r["code"], "NOT_FOUND", "{r}");
    assert_eq!(r["details"], "no such thing");

    let r = grpc_client(&["count", &addr, "5"]);
    assert_eq!(r["code"], "OK", "{r}");
    assert_eq!(r["messages"], serde_json::json!(["0", "1", "2", "3", "4"]));
    assert_eq!(r["trailing"]["x-trailer"], "counted", "trailers after a stream: {r}");

    // Lock-step: message k+1 leaves the client only once the answer to k came back, so this
    // finishes only if both directions stream through the gateway (no buffering).
    let r = grpc_client(&["chat", &addr, "5"]);
    assert_eq!(r["code"], "OK", "{r}");
    assert_eq!(r["replies"], serde_json::json!(["M0", "M1", "M2", "M3", "M4"]));

    let s = server.stats();
    assert_eq!(s["calls"], 4, "{s}");
    assert_eq!(
        s["connections"], 1,
        "one shared HTTP/2 connection carried every call: {s}"
    );
}

#[test]
fn the_fourth_call_over_a_limit_of_three_is_resource_exhausted_in_the_client() {
    let server = GrpcServer::start(&[]);
    let rules = "rules:\n  - { name: echo-unary, match: { path: /tollgate.test.Echo/Echo }, key: ip, algorithm: fixed_window, limit: 3, window: 1h }\n";
    let (gw, _dir) = grpc_gateway(&format!("http://{}", server.addr()), "h2c", rules, "");
    let addr = gw.url.trim_start_matches("http://").to_owned();
    let calls = grpc_client(&["calls", &addr, "4"]);
    let calls = calls.as_array().unwrap();
    for (i, c) in calls[..3].iter().enumerate() {
        assert_eq!(c["code"], "OK", "call {i}: {c}");
        assert_eq!(c["trailing"]["x-trailer"], "bye", "call {i}: {c}");
    }
    assert_eq!(calls[3]["code"], "RESOURCE_EXHAUSTED", "{}", calls[3]);
    let details = calls[3]["details"].as_str().unwrap();
    assert!(
        details.contains("echo-unary") && details.contains("retry in"),
        "{details}"
    );
    assert_eq!(server.stats()["calls"], 3, "the limited call never reached the server");
    // Another method is not matched by the rule.
    let r = grpc_client(&["count", &addr, "1"]);
    assert_eq!(r["code"], "OK", "{r}");
}

#[test]
fn two_hundred_concurrent_calls_are_multiplexed_over_a_few_upstream_connections() {
    // Every Wait call blocks in the server until 200 are in it at once.
    let server = GrpcServer::start(&["--barrier", "200"]);
    let (gw, _dir) = grpc_gateway(&format!("http://{}", server.addr()), "h2c", OPEN, "");
    let addr = gw.url.trim_start_matches("http://").to_owned();
    let r = grpc_client(&["burst", &addr, "200"]);
    assert_eq!(r["codes"], serde_json::json!({"OK": 200}), "{r}");
    let s = server.stats();
    assert_eq!(s["max_in_flight"], 200, "all 200 calls were in the server at once: {s}");
    let conns = s["connections"].as_u64().unwrap();
    assert!(
        (1..=4).contains(&conns),
        "200 concurrent calls took {conns} upstream connections (at most 4 expected): {s}"
    );
    eprintln!("200 concurrent calls over {conns} upstream connection(s)");
}

#[test]
fn an_upstream_goaway_mid_load_fails_calls_only_as_unavailable_and_new_calls_use_new_connections() {
    // grpc.max_connection_age_ms: the server sends GOAWAY on every connection after ~300 ms,
    // so a 3 s load meets about ten of them.
    let server = GrpcServer::start(&["--max-connection-age-ms", "300"]);
    let (gw, _dir) = grpc_gateway(&format!("http://{}", server.addr()), "h2c", OPEN, "");
    let addr = gw.url.trim_start_matches("http://").to_owned();
    let r = grpc_client(&["load", &addr, "3", "8"]);
    let codes = r["codes"].as_object().unwrap();
    let ok = codes.get("OK").and_then(|v| v.as_u64()).unwrap_or(0);
    let unavailable = codes.get("UNAVAILABLE").and_then(|v| v.as_u64()).unwrap_or(0);
    let total: u64 = codes.values().filter_map(|v| v.as_u64()).sum();
    assert_eq!(
        ok + unavailable,
        total,
        "a call either finished or got UNAVAILABLE: {r}"
    );
    assert!(
        ok >= 50 && ok * 100 >= total * 99,
        "at most 1 % of calls may meet a GOAWAY race: {r}"
    );
    let s = server.stats();
    let conns = s["connections"].as_u64().unwrap();
    assert!(
        conns >= 4,
        "after each GOAWAY new calls went to a new connection: {conns} connections: {s}"
    );
    // And once the load is over, a new call still finds a connection.
    let after = grpc_client(&["unary", &addr]);
    assert_eq!(after["code"], "OK", "{after}");
    eprintln!("GOAWAY load: {ok} OK, {unavailable} UNAVAILABLE over {conns} upstream connections");
    drop(gw);
}

#[test]
fn auto_and_h2_speak_http2_to_a_tls_grpc_server_by_alpn() {
    let pki = Pki::new("tollgate grpc test CA");
    let (cert, key) = pki.issue("grpc", &["localhost", "127.0.0.1"]);
    let server = GrpcServer::start(&["--tls", cert.to_str().unwrap(), key.to_str().unwrap()]);
    let ca = pki.ca_path();
    for protocol in ["auto", "h2"] {
        let (gw, _dir) = grpc_gateway(
            &format!("https://localhost:{}", server.port),
            protocol,
            OPEN,
            &format!("  tls: {{ ca_file: {} }}\n", ca.display()),
        );
        let addr = gw.url.trim_start_matches("http://").to_owned();
        let r = grpc_client(&["unary", &addr]);
        assert_eq!(r["code"], "OK", "protocol {protocol}: {r}\n{}", gw.log());
        assert_eq!(r["trailing"]["x-trailer"], "bye", "protocol {protocol}: {r}");
        let r = grpc_client(&["count", &addr, "3"]);
        assert_eq!(
            r["messages"],
            serde_json::json!(["0", "1", "2"]),
            "protocol {protocol}: {r}"
        );
    }
}

/// An h2c server (hyper) that answers with the request's body, then trailers: `x-echo-trailer`
/// holds the request trailer `x-req-trailer` it received (or "none").
async fn trailer_echo() -> std::net::SocketAddr {
    use http_body_util::BodyExt;
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((s, _)) = l.accept().await {
            let svc = hyper::service::service_fn(|req: http::Request<hyper::body::Incoming>| async move {
                let got = req.into_body().collect().await?;
                let echoed = got
                    .trailers()
                    .and_then(|t| t.get("x-req-trailer"))
                    .cloned()
                    .unwrap_or(http::HeaderValue::from_static("none"));
                let mut trailers = http::HeaderMap::new();
                trailers.insert("x-echo-trailer", echoed);
                let frames = vec![
                    Ok::<_, std::convert::Infallible>(hyper::body::Frame::data(got.to_bytes())),
                    Ok(hyper::body::Frame::trailers(trailers)),
                ];
                let body = http_body_util::StreamBody::new(futures_util::stream::iter(frames));
                Ok::<_, hyper::Error>(http::Response::new(body))
            });
            tokio::spawn(
                hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                    .serve_connection(hyper_util::rt::TokioIo::new(s), svc),
            );
        }
    });
    addr
}

#[test]
fn trailers_pass_both_ways_through_an_h2c_upstream() {
    use http_body_util::BodyExt;
    let rt = tokio::runtime::Runtime::new().unwrap();
    let up = rt.block_on(trailer_echo());
    let (gw, _dir) = grpc_gateway(&format!("http://{up}"), "h2c", OPEN, "");
    let gw_addr = gw.url.trim_start_matches("http://").to_owned();
    rt.block_on(async move {
        let s = tokio::net::TcpStream::connect(&gw_addr).await.unwrap();
        let (mut sender, conn) = hyper::client::conn::http2::handshake(
            hyper_util::rt::TokioExecutor::new(),
            hyper_util::rt::TokioIo::new(s),
        )
        .await
        .unwrap();
        tokio::spawn(conn);
        let mut trailers = http::HeaderMap::new();
        trailers.insert("x-req-trailer", http::HeaderValue::from_static("from-client"));
        let frames = vec![
            Ok::<_, std::convert::Infallible>(hyper::body::Frame::data(bytes::Bytes::from_static(b"hello"))),
            Ok(hyper::body::Frame::trailers(trailers)),
        ];
        let req = http::Request::post(format!("http://{gw_addr}/echo.Trailers/Call"))
            .header("te", "trailers")
            .body(http_body_util::StreamBody::new(futures_util::stream::iter(frames)))
            .unwrap();
        let resp = sender.send_request(req).await.unwrap();
        assert_eq!(resp.status(), 200);
        let got = resp.into_body().collect().await.unwrap();
        let echoed = got.trailers().and_then(|t| t.get("x-echo-trailer")).cloned();
        assert_eq!(
            echoed.as_ref().and_then(|v| v.to_str().ok()),
            Some("from-client"),
            "the request trailer reached the upstream and its response trailer came back"
        );
        assert_eq!(&got.to_bytes()[..], b"hello");
    });
}
