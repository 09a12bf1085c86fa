use super::*;

#[test]
fn strips_connection_named_headers() {
    let mut h = HeaderMap::new();
    h.insert(header::CONNECTION, HeaderValue::from_static("close, X-Secret-Hop"));
    h.insert("x-secret-hop", HeaderValue::from_static("1"));
    h.insert("keep-alive", HeaderValue::from_static("timeout=5"));
    h.insert(header::TRANSFER_ENCODING, HeaderValue::from_static("chunked"));
    h.insert("x-end-to-end", HeaderValue::from_static("kept"));
    strip_hop_by_hop(&mut h, None);
    assert_eq!(h.len(), 1);
    assert!(h.contains_key("x-end-to-end"));
}

#[test]
fn appends_forwarding_headers() {
    let mut h = HeaderMap::new();
    h.append(&X_FORWARDED_FOR, HeaderValue::from_static("1.1.1.1"));
    h.append(&X_FORWARDED_FOR, HeaderValue::from_static("2.2.2.2"));
    add_forwarded(
        &mut h,
        "10.0.0.1".parse().unwrap(),
        Some(&HeaderValue::from_static("api.example")),
    );
    assert_eq!(h[&X_FORWARDED_FOR], "1.1.1.1, 2.2.2.2, 10.0.0.1");
    assert_eq!(h[&X_FORWARDED_PROTO], "http");
    assert_eq!(h[&X_FORWARDED_HOST], "api.example");
    assert_eq!(h[&FORWARDED], "for=10.0.0.1;proto=http;host=\"api.example\"");
}

#[test]
fn empty_earlier_values_leave_no_empty_list_member() {
    let mut h = HeaderMap::new();
    h.append(&X_FORWARDED_FOR, HeaderValue::from_static(""));
    h.append(&FORWARDED, HeaderValue::from_static(""));
    add_forwarded(&mut h, "10.0.0.1".parse().unwrap(), None);
    assert_eq!(h[&X_FORWARDED_FOR], "10.0.0.1");
    assert_eq!(h[&FORWARDED], "for=10.0.0.1;proto=http");
}

#[test]
fn only_allow_listed_upgrades_pass() {
    let ws = vec!["websocket".to_owned()];
    let ok = |v: &'static str| upgrade_allowed(&HeaderValue::from_static(v), &ws);
    assert!(ok("websocket"));
    assert!(ok("WebSocket"));
    assert!(!ok("h2c"));
    assert!(!ok("websocket, h2c"));
    assert!(!ok("HTTP/2.0"));
    assert!(!ok(""));
}
