//! The 429 body.

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
