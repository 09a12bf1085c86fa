use super::settings::Target;
use super::*;
use crate::http::tls::UpstreamTls;

fn config(n: usize) -> UpstreamConfig {
    let targets: Vec<Target> = (0..n)
        .map(|i| Target::plain(std::net::SocketAddr::from(([127, 0, 0, 1], 1 + i as u16))))
        .collect();
    UpstreamConfig {
        url: targets[0].url.clone(),
        scheme: http::uri::Scheme::HTTP,
        authority: "127.0.0.1:1".parse().unwrap(),
        targets,
        protocol: UpstreamProtocol::Http1,
        tls: UpstreamTls::default(),
        eject_after: 2,
        eject_for: Duration::from_secs(60),
        health_check: None,
        connect_timeout: Duration::from_millis(100),
        request_timeout: Duration::from_secs(1),
        pool_max_idle_per_host: 4,
        max_connections_per_target: 1024,
    }
}

fn up(n: usize) -> Arc<Upstream> {
    Upstream::new(&config(n), &crate::metrics::Metrics::new()).unwrap()
}

#[test]
fn replayable_means_idempotent_and_no_body() {
    let h = HeaderMap::new();
    assert!(replayable(&Method::GET, &h, true));
    assert!(replayable(&Method::DELETE, &h, false));
    assert!(!replayable(&Method::POST, &h, true));
    let mut with_body = HeaderMap::new();
    with_body.insert(http::header::CONTENT_LENGTH, HeaderValue::from_static("5"));
    assert!(!replayable(&Method::PUT, &with_body, false));
    let mut chunked = HeaderMap::new();
    chunked.insert(http::header::TRANSFER_ENCODING, HeaderValue::from_static("chunked"));
    assert!(!replayable(&Method::GET, &chunked, false));
    let mut zero = HeaderMap::new();
    zero.insert(http::header::CONTENT_LENGTH, HeaderValue::from_static("0"));
    assert!(replayable(&Method::PUT, &zero, false));
}

#[test]
fn p2c_picks_the_less_loaded_of_two() {
    let u = up(2);
    u.targets[0].in_flight.store(10, Ordering::Relaxed);
    for _ in 0..100 {
        assert_eq!(u.pick(None), 1);
    }
    // Avoiding target 1 leaves target 0, however loaded.
    assert_eq!(u.pick(Some(1)), 0);
}

#[test]
fn p2c_spreads_over_equal_targets() {
    let u = up(3);
    let mut seen = [0usize; 3];
    for _ in 0..3000 {
        seen[u.pick(None)] += 1;
    }
    assert!(seen.iter().all(|&n| n > 500), "{seen:?}");
}

#[test]
fn ejection_after_consecutive_failures_doubles_and_spares_the_last_target() {
    let u = up(2);
    u.failure(0, &"x", false);
    assert!(u.status()[0].1, "one failure is not enough");
    u.success(0);
    u.failure(0, &"x", false);
    assert!(u.status()[0].1, "a success reset the count");
    u.failure(0, &"x", false);
    assert!(!u.status()[0].1, "two in a row eject");
    assert_eq!(u.ejections(), 1);
    for _ in 0..100 {
        assert_eq!(u.pick(None), 1, "an ejected target gets nothing");
    }
    let first = u.targets[0].out_until_ms.load(Ordering::Relaxed) - u.now_ms();
    assert!(first <= 60_000 && first > 59_000, "{first}");
    // Target 1 fails too, but it is the last one in: it stays.
    u.failure(1, &"x", false);
    u.failure(1, &"x", false);
    assert!(u.status()[1].1);
    // Target 0 comes back and fails again: out for twice as long.
    u.targets[0].out_until_ms.store(0, Ordering::Relaxed);
    u.failure(0, &"x", false);
    u.failure(0, &"x", false);
    let second = u.targets[0].out_until_ms.load(Ordering::Relaxed) - u.now_ms();
    assert!(second > 119_000 && second <= 120_000, "{second}");
}

#[test]
fn recent_ejections_list_the_newest_first_and_keep_only_the_last_twenty() {
    let u = up(2);
    assert!(u.recent_ejections().is_empty());
    for n in 0..(super::RECENT_EJECTIONS + 5) {
        u.targets[0].out_until_ms.store(0, Ordering::Relaxed);
        u.failure(0, &format!("refused {n}"), true);
    }
    // The last target in is never ejected, so never listed.
    u.failure(1, &"x", true);
    let recent = u.recent_ejections();
    assert_eq!(recent.len(), super::RECENT_EJECTIONS);
    assert_eq!(recent[0].why, format!("refused {}", super::RECENT_EJECTIONS + 4));
    assert_eq!(recent[super::RECENT_EJECTIONS - 1].why, "refused 5");
    assert!(recent.iter().all(|e| e.target == u.targets[0].label && e.at_ms > 0));
    // Consecutive ejections double the period (capped): the newest is out longest.
    assert!(recent[0].out_for_ms >= recent[super::RECENT_EJECTIONS - 1].out_for_ms);
}

#[test]
fn replay_rebuilds_the_request() {
    let mut headers = HeaderMap::new();
    headers.insert("x-a", HeaderValue::from_static("1"));
    let r = Replay {
        method: Method::PUT,
        uri: "/p?q=1".parse().unwrap(),
        headers,
    };
    let req = r.request();
    assert_eq!(req.method(), Method::PUT);
    assert_eq!(req.uri(), "/p?q=1");
    assert_eq!(req.headers()["x-a"], "1");
}

#[test]
fn an_http2_request_carries_scheme_and_authority_and_converts_back() {
    let u = up(1);
    let mut req = Request::new(crate::http::empty());
    *req.uri_mut() = Uri::from_static("/pkg.Service/Method?x=1");
    req.headers_mut()
        .insert(http::header::HOST, HeaderValue::from_static("api.example:8080"));
    to_h2(&mut req, &u.targets[0]);
    assert_eq!(req.uri().to_string(), "http://api.example:8080/pkg.Service/Method?x=1");
    assert_eq!(req.version(), Version::HTTP_2);
    assert!(
        !req.headers().contains_key(http::header::HOST),
        "HTTP/2 says :authority"
    );
    to_h1(&mut req, &HeaderValue::from_static("target.example:1"));
    assert_eq!(req.uri().to_string(), "/pkg.Service/Method?x=1");
    assert_eq!(req.headers()[http::header::HOST], "api.example:8080");
    assert_eq!(req.version(), Version::HTTP_11);

    // No Host: the target's authority.
    let mut req = Request::new(crate::http::empty());
    *req.uri_mut() = Uri::from_static("/x");
    to_h2(&mut req, &u.targets[0]);
    assert_eq!(req.uri().to_string(), "http://127.0.0.1:1/x");
}
