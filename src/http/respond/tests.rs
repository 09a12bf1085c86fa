//! The 429: its body, and the per-thread reuse of the last one made.

#[test]
fn the_429_body_is_json_with_every_field() {
    let body = super::rate_limited_body("api.v1-x", 100, 60_000_000, 7, 1_800_000_007);
    let v: serde_json::Value = serde_json::from_slice(&body).expect("valid JSON");
    assert_eq!(v["error"], "rate_limit_exceeded");
    assert_eq!(
        v["message"],
        "Rate limit of 100 per 1m exceeded for rule api.v1-x; retry in 7 s."
    );
    assert_eq!(v["rule"], "api.v1-x");
    assert_eq!(v["limit"], 100);
    assert_eq!(v["window"], "1m");
    assert_eq!(v["retry_after"], 7);
    let reset_at = v["reset_at"].as_str().expect("reset_at");
    assert_eq!(reset_at, "2027-01-15T08:00:07Z");
}

/// A 429 for `rule` at `limit` per minute, retrying in `retry_us`, decided at `at_us`.
fn deny(rule: &str, limit: u64, retry_us: u64, at_us: u64) -> http::Response<crate::http::ProxyBody> {
    use std::num::NonZeroU64;
    let outcome = crate::limiter::Outcome {
        allowed: false,
        retry_after_us: retry_us,
        reset_us: retry_us,
        at_us,
        ..Default::default()
    };
    let quota = crate::limiter::Quota::window(
        crate::limiter::Algorithm::FixedWindow,
        NonZeroU64::new(limit).unwrap(),
        NonZeroU64::new(60_000_000).unwrap(),
    );
    let b = crate::http::headers::Binding {
        rule,
        quota,
        cost: 1,
        outcome: &outcome,
        fixed: None,
        windows: &[],
        at: 0,
        units: &[],
    };
    super::rate_limited(&b, true, true, at_us)
}

/// A response's headers as text, and its body.
fn text(r: &http::Response<crate::http::ProxyBody>) -> (Vec<(String, String)>, bytes::Bytes) {
    let headers = r
        .headers()
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_str().unwrap().to_owned()))
        .collect();
    let crate::http::ProxyBody::Full(Some(body)) = r.body() else {
        panic!("a 429 has a body");
    };
    (headers, body.clone())
}

#[test]
fn a_repeated_429_is_the_same_text_shared_not_rebuilt() {
    let at = 1_800_000_000_250_000;
    let (h1, b1) = text(&deny("memo-same", 10, 2_500_000, at));
    let (h2, b2) = text(&deny("memo-same", 10, 2_500_000, at + 100_000));
    assert_eq!(h1, h2);
    assert_eq!(b1, b2);
    // Reused, not rebuilt: the second body is the first one's allocation.
    assert_eq!(b1.as_ptr(), b2.as_ptr());
    assert!(h1.contains(&("retry-after".into(), "3".into())), "{h1:?}");
    assert!(
        h1.contains(&("x-ratelimit-reset".into(), "1800000003".into())),
        "{h1:?}"
    );
}

#[test]
fn a_429_is_rebuilt_when_anything_it_says_changes() {
    let at = 1_800_000_000_250_000;
    let (h1, b1) = text(&deny("memo-change", 10, 2_500_000, at));
    // Another second to wait.
    let (h2, b2) = text(&deny("memo-change", 10, 3_500_000, at));
    assert_ne!(b1.as_ptr(), b2.as_ptr());
    assert!(h2.contains(&("retry-after".into(), "4".into())), "{h2:?}");
    assert!(
        h2.contains(&("x-ratelimit-reset".into(), "1800000004".into())),
        "{h2:?}"
    );
    assert!(std::str::from_utf8(&b2).unwrap().contains("retry in 4 s"));
    // Another rule with every number equal.
    let (h3, b3) = text(&deny("memo-other", 10, 3_500_000, at));
    assert!(std::str::from_utf8(&b3).unwrap().contains("\"rule\":\"memo-other\""));
    assert!(
        h3.iter()
            .any(|(k, v)| k == "ratelimit" && v.starts_with("\"memo-other\"")),
        "{h3:?}"
    );
    // Another limit.
    let (h4, _) = text(&deny("memo-other", 11, 3_500_000, at));
    assert!(h4.contains(&("x-ratelimit-limit".into(), "11".into())), "{h4:?}");
    // The clock past the reset second: a later reset.
    let (h5, _) = text(&deny("memo-other", 11, 3_500_000, at + 1_000_000));
    assert!(
        h5.contains(&("x-ratelimit-reset".into(), "1800000005".into())),
        "{h5:?}"
    );
    assert_ne!(h1, h2);
}

/// Every local answer is one value with an HTTP status and a gRPC code, rendered either way:
/// HTTP gets its status and a JSON body, gRPC gets 200, `grpc-status` and a message, and both
/// keep `Retry-After` and the credential challenge.
#[test]
fn a_local_answer_renders_as_http_or_as_grpc_from_one_value() {
    use super::{GatewayError, GrpcCode, LocalAnswer};
    use http::StatusCode;
    let cases = [
        (GatewayError::BadRequest("x"), 400, GrpcCode::InvalidArgument),
        (GatewayError::InvalidCredentials, 401, GrpcCode::Unauthenticated),
        (GatewayError::PayloadTooLarge, 413, GrpcCode::ResourceExhausted),
        (GatewayError::HeadersTooLarge, 431, GrpcCode::ResourceExhausted),
        (GatewayError::NotImplemented("gzip"), 501, GrpcCode::Unimplemented),
        (GatewayError::BadGateway("refused".into()), 502, GrpcCode::Unavailable),
        (GatewayError::Unavailable("draining"), 503, GrpcCode::Unavailable),
        (GatewayError::GatewayTimeout, 504, GrpcCode::Unavailable),
        (
            GatewayError::LimiterUnavailable {
                rule: "login".into(),
                retry_after_secs: 1,
            },
            503,
            GrpcCode::Unavailable,
        ),
    ];
    for (e, status, code) in cases {
        let shown = format!("{e:?}");
        let a = LocalAnswer::from(e);
        assert_eq!(a.status(), StatusCode::from_u16(status).unwrap(), "{shown}");
        assert_eq!(a.grpc_code(), code, "{shown}");
        let http = a.clone().http();
        assert_eq!(http.status().as_u16(), status, "{shown}");
        assert_eq!(http.headers()["content-type"], "application/json", "{shown}");
        let grpc = a.grpc();
        assert_eq!(grpc.status(), StatusCode::OK, "{shown}: gRPC clients read grpc-status");
        assert_eq!(grpc.headers()["grpc-status"], (code as i32).to_string(), "{shown}");
        assert_eq!(grpc.headers()["content-type"], "application/grpc", "{shown}");
        assert!(grpc.headers().contains_key("grpc-message"), "{shown}");
        assert_eq!(
            http.headers().get("retry-after"),
            grpc.headers().get("retry-after"),
            "{shown}: Retry-After either way"
        );
        assert_eq!(
            http.headers().get("www-authenticate"),
            grpc.headers().get("www-authenticate"),
            "{shown}: the challenge either way"
        );
    }
}
