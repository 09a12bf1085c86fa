//! Hostile client, rate limits: a client that tries to be charged less than its limit says, by
//! spelling the request another way than the upstream reads it, or by switching protocol.
//! Against the real binary and a raw upstream that records what reaches it, so every test checks
//! both the answer and what the upstream saw (what the matcher decides on is what the upstream
//! receives: ARCHITECTURE.md).
//!
//! | way around the limit | defence | test |
//! |---|---|---|
//! | path spellings an upstream decodes (`%2F`, `\`, `%00`, `%3B`, trailing `.`/space) | refused (400), or forwarded as the matched spelling | `path_spellings_the_upstream_decodes_never_reach_it_uncounted` |
//! | letter case, for case-insensitive upstreams | `match.ignore_case` | the same |
//! | `X-HTTP-Method-Override` past a method rule | method conditions read it (`match.method_override`, default on) | the same |
//! | `GET *` | 400 (asterisk-form is for OPTIONS) | the same |
//! | `Upgrade: h2c`, a tunnel past every later limit | only `server.upgrades` (websocket) pass; others go as plain requests | `an_h2c_upgrade_is_forwarded_as_a_plain_request_and_counted` |
//! | absolute-form target naming another host than `Host` | the target's authority is the host, for rules and upstream | `the_targets_authority_is_the_host_for_rules_and_upstream` |
//! | `Host: user@evil.example`, HTTP/1.0 without Host, `Transfer-Encoding: gzip, chunked` | 400, a Host for the upstream, 501 | `malformed_hosts_and_codings_are_refused_before_the_upstream` |
//! | `post` for `POST`, for upstreams that upper-case the method (Django, Flask) | 400: methods are case-sensitive | `method_credential_and_key_spellings_never_reach_the_upstream_uncounted` |
//! | `X_API_KEY` for `X-API-Key`, `X_Tenant` for a key header (CGI-style upstreams read both as one) | 400 for a header tollgate reads spelled with `_` | the same |
//! | a key header sent twice or as a list (`X-Tenant: decoy, acme`) | 400, as for credentials | the same |
//! | Unicode that case-folds to the path of an `ignore_case` rule (KELVIN SIGN, LONG S) | folded as Unicode routers fold it | the same |
//! | `CONNECT`; a target with a fragment (`http://h#/x`) | 400 before any limit is spent; the fragment is dropped (`/`, matched and forwarded) | the same |

mod support;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A raw HTTP/1.1 upstream that records every request head it gets (keep-alive, bodies are
/// `Content-Length: 0`). It answers `101` to a request that asks to upgrade to h2c (as Go's
/// h2c handler, Jetty and Node do) and then echoes whatever comes through the tunnel; anything
/// else gets `200 ok`.
struct Upstream {
    addr: SocketAddr,
    heads: Arc<Mutex<Vec<String>>>,
}

impl Upstream {
    async fn start() -> Upstream {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let heads = Arc::new(Mutex::new(Vec::new()));
        let h2 = heads.clone();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                let heads = h2.clone();
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = vec![0u8; 16 * 1024];
                    loop {
                        while let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                            let head = String::from_utf8_lossy(&buf[..end]).into_owned();
                            buf.drain(..end + 4);
                            let h2c = head.to_ascii_lowercase().contains("\nupgrade: h2c");
                            heads.lock().unwrap().push(head);
                            if h2c {
                                let _ = s
                                    .write_all(b"HTTP/1.1 101 Switching Protocols\r\nconnection: upgrade\r\nupgrade: h2c\r\n\r\n")
                                    .await;
                                // The tunnel: everything is answered, nothing is limited.
                                loop {
                                    match s.read(&mut chunk).await {
                                        Ok(0) | Err(_) => return,
                                        Ok(n) => {
                                            let _ = s.write_all(&chunk[..n]).await;
                                        }
                                    }
                                }
                            }
                            let _ = s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok").await;
                        }
                        match s.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                });
            }
        });
        Upstream { addr, heads }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The request heads received so far.
    fn heads(&self) -> Vec<String> {
        self.heads.lock().unwrap().clone()
    }

    /// Request lines (`GET /p HTTP/1.1`) whose path starts with `prefix`.
    fn lines_for(&self, prefix: &str) -> Vec<String> {
        self.heads()
            .iter()
            .filter_map(|h| h.lines().next().map(str::to_owned))
            .filter(|l| l.split(' ').nth(1).is_some_and(|p| p.starts_with(prefix)))
            .collect()
    }
}

fn addr_of(url: &str) -> SocketAddr {
    url.trim_start_matches("http://").parse().unwrap()
}

/// Send raw bytes on a fresh connection and read until it closes (or 5 s).
async fn raw(addr: SocketAddr, bytes: &[u8]) -> String {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let _ = s.write_all(bytes).await;
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

fn status_of(resp: &str) -> u16 {
    resp.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0)
}

/// Status of one `Connection: close` request with `extra` header lines.
async fn status(addr: SocketAddr, method: &str, target: &str, extra: &str) -> u16 {
    let req = format!(
        "{method} {target} HTTP/1.1\r\nHost: api.example\r\n{extra}Content-Length: 0\r\nConnection: close\r\n\r\n"
    );
    status_of(&raw(addr, req.as_bytes()).await)
}

#[tokio::test]
async fn path_spellings_the_upstream_decodes_never_reach_it_uncounted() {
    let up = Upstream::start().await;
    let rules = r#"rules:
  - { name: login, match: { path: /api/v1/login, methods: [POST], ignore_case: true }, key: ip, algorithm: fixed_window, limit: 1, window: 1h }
  - { name: open, match: { path: "/**" }, key: global, algorithm: fixed_window, limit: 1000000, window: 1h }
"#;
    let gw = binary(&up.url(), "", rules);
    let a = addr_of(&gw.url);
    assert_eq!(status(a, "POST", "/api/v1/login", "").await, 200);
    assert_eq!(status(a, "POST", "/api/v1/login", "").await, 429);
    let mut got = Vec::new();
    for (method, target, extra) in [
        ("POST", "/api%2Fv1%2Flogin", ""),
        ("POST", "/api/v1%2flogin", ""),
        ("POST", "/api/v1%5Clogin", ""),
        ("POST", "/api\\v1\\login", ""),
        ("POST", "/API/v1/login", ""),
        ("POST", "/api/V1/LOGIN/", ""),
        ("POST", "/api/v1/login%3bx", ""),
        ("POST", "/api/v1/login%20", ""),
        ("POST", "/api/v1/login%00", ""),
        ("POST", "/api/v1/login.", ""),
        ("POST", "/api/v1/log%69n", ""),
        ("POST", "/api/v1/x/..%2F..%2Fv1/login", ""),
        ("GET", "*", ""),
        ("GET", "/api/v1/login", "X-HTTP-Method-Override: POST\r\n"),
        ("GET", "/api/v1/login", "X-Method-Override: post\r\n"),
    ] {
        let code = status(a, method, target, extra).await;
        got.push((method, target, extra, code));
    }
    for g in &got {
        assert!(
            g.3 == 400 || g.3 == 429,
            "a spelling dodged the login rule: {g:?}\nall: {got:?}"
        );
    }
    // The upstream saw the one admitted login, and nothing else under /api.
    assert_eq!(up.lines_for("/api").len(), 1, "{:?}", up.heads());
    assert_eq!(up.lines_for("/API").len(), 0, "{:?}", up.heads());

    // What is forwarded is the spelling the rules matched: decoded, dot-segments resolved,
    // `;params` dropped, the query untouched; a trailing slash kept.
    assert_eq!(
        status(a, "GET", "/other/./p%61th;jsessionid=1//x/?q=%2F", "").await,
        200
    );
    let lines = up.lines_for("/other");
    assert_eq!(lines, ["GET /other/path/x/?q=%2F HTTP/1.1"], "{:?}", up.heads());
    // The 400 says why.
    let resp = raw(
        a,
        b"GET /a%2Fb HTTP/1.1\r\nHost: api.example\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(resp.contains("encoded '/'") && resp.contains("bad_request"), "{resp}");
}

#[tokio::test]
async fn encoded_slashes_keep_passes_them_as_data_matched_and_forwarded_encoded() {
    let up = Upstream::start().await;
    let rules = "rules:\n  - { name: files, match: { path: \"/files/*\" }, key: ip, algorithm: fixed_window, limit: 1, window: 1h }\n";
    let gw = binary(&up.url(), "server:\n  encoded_slashes: keep\n", rules);
    let a = addr_of(&gw.url);
    assert_eq!(status(a, "GET", "/files/a%2fb", "").await, 200);
    assert_eq!(status(a, "GET", "/files/a%2Fb", "").await, 429);
    assert_eq!(up.lines_for("/files"), ["GET /files/a%2Fb HTTP/1.1"]);
    // A literal backslash is still refused.
    assert_eq!(status(a, "GET", "/files/a\\b", "").await, 400);
}

#[tokio::test]
async fn an_h2c_upgrade_is_forwarded_as_a_plain_request_and_counted() {
    let up = Upstream::start().await;
    let rules = "rules:\n  - { name: per-ip, match: { path: \"/**\" }, key: ip, algorithm: fixed_window, limit: 3, window: 1h }\n";
    let gw = binary(&up.url(), "", rules);
    let a = addr_of(&gw.url);
    // What `curl --http2` sends on cleartext. The upstream would switch and tunnel.
    let upgrade = b"GET /tunnel HTTP/1.1\r\nHost: api.example\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n\r\n";
    let mut s = TcpStream::connect(a).await.unwrap();
    s.write_all(upgrade).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
        .await
        .unwrap()
        .unwrap();
    let resp = String::from_utf8_lossy(&buf[..n]).into_owned();
    assert_eq!(status_of(&resp), 200, "the upgrade went through: {resp}");
    let heads = up.heads();
    assert_eq!(heads.len(), 1);
    let head = heads[0].to_ascii_lowercase();
    assert!(
        !head.contains("\nupgrade:") && !head.contains("http2-settings"),
        "{head}"
    );
    // The same connection is still plain HTTP/1.1, and every request on it is counted.
    let mut codes = vec![200];
    for _ in 0..4 {
        s.write_all(b"GET /tunnel HTTP/1.1\r\nHost: api.example\r\n\r\n")
            .await
            .unwrap();
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        codes.push(status_of(&String::from_utf8_lossy(&buf[..n])));
    }
    assert_eq!(codes, [200, 200, 200, 429, 429]);
    assert_eq!(up.heads().len(), 3);

    // An allow-listed upgrade still passes through to the upstream (websocket).
    let ws = b"GET /ws HTTP/1.1\r\nHost: api.example\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n";
    let gw2 = binary(&up.url(), "", "rules: []\n");
    let mut s = TcpStream::connect(addr_of(&gw2.url)).await.unwrap();
    s.write_all(ws).await.unwrap();
    let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
        .await
        .unwrap()
        .unwrap();
    let _ = n;
    let last = up.heads().last().cloned().unwrap_or_default().to_ascii_lowercase();
    assert!(
        last.starts_with("get /ws") && last.contains("\nupgrade: websocket"),
        "{last}"
    );
}

#[tokio::test]
async fn the_targets_authority_is_the_host_for_rules_and_upstream() {
    let up = Upstream::start().await;
    let rules = "rules:\n  - { name: a-host, match: { path: \"/**\", host: a.example }, key: ip, algorithm: fixed_window, limit: 1, window: 1h }\n";
    let gw = binary(&up.url(), "", rules);
    let a = addr_of(&gw.url);
    let req = |host: &str| {
        format!("GET http://a.example/x HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
    };
    assert_eq!(status_of(&raw(a, req("a.example").as_bytes()).await), 200);
    // `Host: b.example` does not take the request out of a.example's rule.
    assert_eq!(status_of(&raw(a, req("b.example").as_bytes()).await), 429);
    let heads = up.heads();
    assert_eq!(heads.len(), 1);
    assert!(heads[0].to_ascii_lowercase().contains("\nhost: a.example"), "{heads:?}");
}

#[tokio::test]
async fn malformed_hosts_and_codings_are_refused_before_the_upstream() {
    let up = Upstream::start().await;
    let gw = binary(&up.url(), "", "rules: []\n");
    let a = addr_of(&gw.url);
    let r = raw(
        a,
        b"GET /x HTTP/1.1\r\nHost: user@evil.example\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status_of(&r), 400, "{r}");
    let r = raw(
        a,
        b"POST /x HTTP/1.1\r\nHost: api.example\r\nTransfer-Encoding: gzip, chunked\r\nConnection: close\r\n\r\n0\r\n\r\n",
    )
    .await;
    assert_eq!(status_of(&r), 501, "{r}");
    assert!(r.contains("not_implemented"), "{r}");
    assert!(up.heads().is_empty(), "{:?}", up.heads());
    // HTTP/1.0 without Host: forwarded as HTTP/1.1 with the target's Host.
    let r = raw(a, b"GET /old HTTP/1.0\r\n\r\n").await;
    assert_eq!(status_of(&r), 200, "{r}");
    let heads = up.heads();
    assert_eq!(heads.len(), 1);
    let want = format!("\nhost: {}", up.addr);
    assert!(heads[0].to_ascii_lowercase().contains(&want), "{heads:?}");
}

/// The hostile client's spellings of the method, the credentials and a key header, and Unicode
/// that case-folds to a limited path: each is either refused (400) before the upstream, or
/// counted against the limit it spells.
#[tokio::test]
async fn method_credential_and_key_spellings_never_reach_the_upstream_uncounted() {
    let up = Upstream::start().await;
    let rules = r#"rules:
  - { name: login, match: { path: /api/v1/login, methods: [POST] }, key: ip, algorithm: sliding_log, limit: 1, window: 24h }
  - { name: tasks, match: { path: /api/v1/tasks, ignore_case: true }, key: ip, algorithm: sliding_log, limit: 1, window: 24h }
  - { name: tenant, match: { path: "/t/**" }, key: "header:X-Tenant", algorithm: fixed_window, limit: 1, window: 24h }
  - { name: free-user, match: { path: "/k/**", tier: free }, key: user, limit: 1, window: 24h }
  - { name: open, match: { path: "/**" }, key: global, algorithm: fixed_window, limit: 1000000, window: 1h }
"#;
    let dir = tempfile::tempdir().unwrap();
    let key = "k-free-aaaa";
    let sha = tollgate::identity::keys::hash_key(key);
    std::fs::write(
        dir.path().join("keys.yaml"),
        format!("keys:\n  - {{ id: cust_1, sha256: {sha}, tier: free }}\n"),
    )
    .unwrap();
    let keys_file = dir.path().join("keys.yaml").display().to_string();
    let gw = binary(&up.url(), &format!("keys_file: {keys_file}\n"), rules);
    let a = addr_of(&gw.url);
    // Spend each limit once.
    assert_eq!(status(a, "POST", "/api/v1/login", "").await, 200);
    assert_eq!(status(a, "GET", "/api/v1/tasks", "").await, 200);
    assert_eq!(status(a, "GET", "/t/x", "X-Tenant: acme\r\n").await, 200);
    let with_key = format!("X-API-Key: {key}\r\n");
    assert_eq!(status(a, "GET", "/k/x", &with_key).await, 200);
    let mut got = Vec::new();
    for (method, target, extra) in [
        ("post", "/api/v1/login", String::new()),
        ("Post", "/api/v1/login", String::new()),
        ("pOST", "/api/v1/login", String::new()),
        ("GET", "/api/v1/ta%C5%BFks", String::new()),
        ("GET", "/api/v1/tas%E2%84%AAs", String::new()),
        ("GET", "/API/V1/TASKS", String::new()),
        ("GET", "/t/x", "X-Tenant: decoy2\r\nX-Tenant: acme\r\n".into()),
        ("GET", "/t/x", "X-Tenant: acme, decoy3\r\n".into()),
        ("GET", "/t/x", "X-Tenant: decoy4, acme\r\n".into()),
        ("GET", "/t/x", "X_Tenant: acme\r\n".into()),
        ("GET", "/t/x", "X-Tenant: decoy5\r\nX_TENANT: acme\r\n".into()),
        ("GET", "/t/x", "X-Tenant:\r\nX-Tenant: acme\r\n".into()),
        ("GET", "/k/x", format!("X_API_KEY: {key}\r\n")),
        ("GET", "/k/x", format!("X_Api_Key: {key}\r\n")),
        ("GET", "/k/x", format!("X-API-Key:\r\nX_API_KEY: {key}\r\n")),
        ("CONNECT", "/api/v1/login", String::new()),
    ] {
        let code = status(a, method, target, &extra).await;
        got.push((method, target, extra, code));
    }
    for g in &got {
        assert!(
            g.3 == 400 || g.3 == 429,
            "a spelling dodged its limit: {g:?}\nall: {got:?}"
        );
    }
    let lines = |p: &str| {
        up.heads()
            .iter()
            .filter(|h| h.lines().next().is_some_and(|l| l.contains(p)))
            .count()
    };
    assert_eq!(lines("/api/v1/login"), 1, "{:?}", up.heads());
    assert_eq!(lines("/api/v1/ta"), 1, "{:?}", up.heads());
    assert_eq!(lines("/API/V1"), 0, "{:?}", up.heads());
    assert_eq!(lines("/t/x"), 1, "{:?}", up.heads());
    assert_eq!(lines("/k/x"), 1, "{:?}", up.heads());
    // A fragment is no part of the target: `http://h#/api/v1/login` is `/`, matched and
    // forwarded as `/` (never an empty request-target).
    assert_eq!(status(a, "POST", "http://api.example#/api/v1/login", "").await, 200);
    assert!(
        up.heads().iter().any(|h| h.starts_with("POST / HTTP/1.1\r\n")),
        "{:?}",
        up.heads()
    );
    let resp = raw(a, b"post /x HTTP/1.1\r\nHost: api.example\r\nConnection: close\r\n\r\n").await;
    assert!(resp.contains("case-sensitive"), "the 400 says why: {resp}");
    let resp = raw(
        a,
        b"GET /t/y HTTP/1.1\r\nHost: api.example\r\nX_Tenant: acme\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert!(resp.contains("'_'"), "the 400 says why: {resp}");
    // An underscore header tollgate does not read passes (and is not counted as a spelling).
    assert_eq!(status(a, "GET", "/other", "X_Custom_Thing: 1\r\n").await, 200);
}
