//! TLS end to end, against real parts: certificates made here with rcgen; curl and reqwest
//! (rustls) as clients; an HTTPS upstream; certificate rotation under load; Redis over TLS with
//! a password, standalone and cluster.

mod support;

use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// `tls:` for the listener.
fn tls_block(cert: &Path, key: &Path) -> String {
    format!("tls:\n  cert_file: {}\n  key_file: {}\n", cert.display(), key.display())
}

/// `https://127.0.0.1:PORT`.
fn https(gw: &TestGateway) -> String {
    format!("https://127.0.0.1:{}", gw.addr().port())
}

/// Run curl with `args`; (exit success, stdout).
async fn curl(args: Vec<String>) -> (bool, String) {
    tokio::task::spawn_blocking(move || {
        let out = Command::new("curl")
            .args(["-sS", "--max-time", "10"])
            .args(&args)
            .output()
            .expect("curl must be installed (the TLS tests never skip)");
        (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned())
    })
    .await
    .unwrap()
}

/// A reqwest client (rustls) that trusts only `ca`.
fn tls_client(ca: &str) -> reqwest::Client {
    reqwest::Client::builder()
        .use_rustls_tls()
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(ca.as_bytes()).unwrap())
        .https_only(true)
        .build()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn curl_and_reqwest_speak_tls_1_2_and_1_3_with_h2_and_http1() {
    let pki = Pki::new("gateway CA");
    let (cert, key) = pki.issue("gw", &["localhost", "127.0.0.1"]);
    let echo = echo().await;
    let gw = gateway(&format!("http://{echo}"), &tls_block(&cert, &key), OPEN_RULES, None).await;
    let base = https(&gw);
    let ca = pki.ca_path().display().to_string();

    // curl: HTTP/2 by ALPN, HTTP/1.1, TLS 1.2 only, TLS 1.3.
    for (extra, want_version) in [
        (vec!["--http2"], "2"),
        (vec!["--http1.1"], "1.1"),
        (vec!["--tlsv1.2", "--tls-max", "1.2"], "2"),
        (vec!["--tlsv1.3"], "2"),
    ] {
        let mut args: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        args.extend(["--cacert".into(), ca.clone(), "-o".into(), "/dev/null".into()]);
        args.extend([
            "-w".into(),
            "%{http_code} %{http_version}".into(),
            format!("{base}/hello"),
        ]);
        let (ok, out) = curl(args).await;
        assert!(ok, "curl {extra:?} failed: {out}");
        assert_eq!(out, format!("200 {want_version}"), "curl {extra:?}");
    }
    // A client that does not trust the CA is refused.
    let (ok, _) = curl(vec!["-o".into(), "/dev/null".into(), format!("{base}/hello")]).await;
    assert!(!ok, "curl without --cacert must fail verification");
    // Plain HTTP to the TLS port gets no HTTP answer.
    let plain = client()
        .get(format!("http://127.0.0.1:{}/hello", gw.addr().port()))
        .send()
        .await;
    assert!(plain.is_err() || plain.unwrap().status() != 200);

    // reqwest with rustls: the upstream learns the client spoke https.
    let c = tls_client(&pki.ca_pem());
    let r = c.get(format!("{base}/hello?x=1")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.headers().contains_key("ratelimit-policy"));
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["path"], "/hello");
    assert_eq!(v["headers"]["x-forwarded-proto"], "https");
    assert!(v["headers"]["forwarded"].as_str().unwrap().contains("proto=https"));
    // Over HTTP/2 (ALPN) too.
    let c2 = reqwest::Client::builder()
        .use_rustls_tls()
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(pki.ca_pem().as_bytes()).unwrap())
        .http2_prior_knowledge()
        .build()
        .unwrap();
    let r = c2.get(format!("{base}/h2")).send().await.unwrap();
    assert_eq!(r.version(), reqwest::Version::HTTP_2);
    assert_eq!(r.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_requires_a_client_certificate_from_the_ca() {
    let pki = Pki::new("gateway CA");
    let (cert, key) = pki.issue("gw", &["127.0.0.1"]);
    let clients = Pki::new("client CA");
    let (ccert, ckey) = clients.issue("client", &["client-1"]);
    let stranger = Pki::new("stranger CA");
    let (scert, skey) = stranger.issue("stranger", &["client-2"]);
    let echo = echo().await;
    let extra = format!(
        "{}  client_ca_file: {}\n",
        tls_block(&cert, &key),
        clients.ca_path().display()
    );
    let gw = gateway(&format!("http://{echo}"), &extra, OPEN_RULES, None).await;
    let url = format!("{}/m", https(&gw));
    let ca = pki.ca_path().display().to_string();
    let base = vec![
        "--cacert".to_string(),
        ca,
        "-o".into(),
        "/dev/null".into(),
        "-w".into(),
        "%{http_code}".into(),
    ];
    let (ok, _) = curl([base.clone(), vec![url.clone()]].concat()).await;
    assert!(!ok, "no client certificate: the handshake must fail");
    let with = |c: &Path, k: &Path| {
        [
            base.clone(),
            vec![
                "--cert".into(),
                c.display().to_string(),
                "--key".into(),
                k.display().to_string(),
                url.clone(),
            ],
        ]
        .concat()
    };
    let (ok, _) = curl(with(&scert, &skey)).await;
    assert!(!ok, "a certificate from another CA must be refused");
    let (ok, out) = curl(with(&ccert, &ckey)).await;
    assert!(ok && out == "200", "client certificate from the CA: {ok} {out}");
}

/// A binary gateway in front of `upstream` (which may carry `upstream.tls` lines).
fn binary_to(upstream: &str, extra: &str) -> BinaryGateway {
    binary(upstream, extra, OPEN_RULES)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_upstream_is_verified_and_a_mismatching_certificate_is_a_502_with_a_clear_log() {
    let pki = Pki::new("upstream CA");
    let (good_c, good_k) = pki.issue("good", &["localhost"]);
    let (bad_c, bad_k) = pki.issue("bad", &["other.example"]);
    let good = https_echo(&good_c, &good_k, None).await;
    let bad = https_echo(&bad_c, &bad_k, None).await;
    let ca = pki.ca_path().display().to_string();
    let c = client();

    // Verified against ca_file, SNI/name "localhost": 200, with the Host the client sent.
    let gw = binary_to(
        &format!("https://localhost:{}\n  tls: {{ ca_file: {ca} }}", good.port()),
        "",
    );
    let r = c.get(format!("{}/v?q=1", gw.url)).send().await.unwrap();
    assert_eq!(r.status(), 200, "{}", gw.log());
    let v: serde_json::Value = r.json().await.unwrap();
    assert_eq!(v["path"], "/v");

    // The certificate names another host: 502, and the log says why.
    let gw = binary_to(
        &format!("https://localhost:{}\n  tls: {{ ca_file: {ca} }}", bad.port()),
        "",
    );
    let r = c.get(format!("{}/v", gw.url)).send().await.unwrap();
    assert_eq!(r.status(), 502);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["error"], "bad_gateway");
    let logged = eventually(Duration::from_secs(5), || async {
        let l = gw.log();
        l.contains("TLS handshake with upstream failed") && l.contains("certificate not valid for name")
    })
    .await;
    assert!(logged, "no clear log line: {}", gw.log());

    // The same certificate is right under `server_name`: an upstream addressed by IP, or by a
    // name its certificate does not carry, is verified against the configured name.
    let gw = binary_to(
        &format!(
            "https://127.0.0.1:{}\n  tls: {{ ca_file: {ca}, server_name: other.example }}",
            bad.port()
        ),
        "",
    );
    let r = c.get(format!("{}/v", gw.url)).send().await.unwrap();
    assert_eq!(r.status(), 200, "server_name override: {}", gw.log());

    // Not trusted (webpki roots only): 502 too.
    let gw = binary_to(&format!("https://localhost:{}", good.port()), "");
    let r = c.get(format!("{}/v", gw.url)).send().await.unwrap();
    assert_eq!(r.status(), 502);
    assert!(
        eventually(Duration::from_secs(5), || async {
            gw.log().contains("TLS handshake with upstream failed") && gw.log().contains("UnknownIssuer")
        })
        .await,
        "{}",
        gw.log()
    );

    // insecure_skip_verify passes the mismatching certificate, and says so at start.
    let gw = binary_to(
        &format!(
            "https://localhost:{}\n  tls: {{ insecure_skip_verify: true }}",
            bad.port()
        ),
        "",
    );
    let r = c.get(format!("{}/v", gw.url)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    assert!(gw.log().contains("insecure_skip_verify is true"), "{}", gw.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_upstream_can_require_the_gateways_client_certificate() {
    let pki = Pki::new("upstream CA");
    let (sc, sk) = pki.issue("up", &["localhost"]);
    let (cc, ck) = pki.issue("gwclient", &["tollgate"]);
    let up = https_echo(&sc, &sk, Some(&pki.ca_path())).await;
    let ca = pki.ca_path().display().to_string();
    let c = client();
    let without = gateway(
        &format!("https://localhost:{}\n  tls: {{ ca_file: {ca} }}", up.port()),
        "",
        OPEN_RULES,
        None,
    )
    .await;
    assert_eq!(c.get(format!("{}/x", without.url)).send().await.unwrap().status(), 502);
    let with = gateway(
        &format!(
            "https://localhost:{}\n  tls: {{ ca_file: {ca}, client_cert_file: {}, client_key_file: {} }}",
            up.port(),
            cc.display(),
            ck.display()
        ),
        "",
        OPEN_RULES,
        None,
    )
    .await;
    assert_eq!(c.get(format!("{}/x", with.url)).send().await.unwrap().status(), 200);
}

/// Over TLS (no ALPN: HTTP/1.1), send `bytes` on a new connection and read until the server
/// closes (or `wait`); what was read, even if the close was not clean.
async fn tls_send(connector: &tokio_rustls::TlsConnector, addr: std::net::SocketAddr, bytes: &[u8]) -> String {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let mut tls = connector.connect(name, tcp).await.unwrap();
    let _ = tls.write_all(bytes).await;
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), tls.read_to_end(&mut buf)).await;
    String::from_utf8_lossy(&buf).into_owned()
}

#[test]
fn request_heads_hypers_parser_refuses_get_json_answers_over_tls_from_the_binary() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let pki = Pki::new("parse-error CA");
    let (cert, key) = pki.issue("gw", &["127.0.0.1"]);
    let echo = rt.block_on(echo());
    let gw = binary(&format!("http://{echo}"), &tls_block(&cert, &key), OPEN_RULES);
    let addr: std::net::SocketAddr = gw.url.trim_start_matches("http://").parse().unwrap();
    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert_der(&pki.ca_path())).unwrap();
    let cfg = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(cfg));
    rt.block_on(async {
        // Past hyper's buffer (twice the default 16 KiB of headers; hyper reads in chunks of
        // up to that size, so a head under 64 KiB may still reach tollgate's own check, and
        // over TLS a 40 KiB one did).
        let huge = format!(
            "GET /x HTTP/1.1\r\nHost: h\r\nX-Huge: {}\r\nConnection: close\r\n\r\n",
            "a".repeat(96 * 1024)
        );
        for (req, status, code) in [
            (huge.as_bytes(), "431", "request_header_fields_too_large"),
            (b"GET /a b HTTP/1.1\r\nHost: h\r\n\r\n".as_slice(), "400", "bad_request"),
        ] {
            let r = tls_send(&connector, addr, req).await;
            assert!(r.starts_with(&format!("HTTP/1.1 {status} ")), "{r:?}");
            let (head, body) = r.split_once("\r\n\r\n").unwrap_or_default();
            assert!(head.contains("\r\ncontent-type: application/json\r\n"), "{r:?}");
            assert!(head.contains("\r\nconnection: close\r\n"), "{r:?}");
            assert!(
                head.contains(&format!("\r\ncontent-length: {}\r\n", body.len())),
                "{r:?}"
            );
            let v: serde_json::Value = serde_json::from_str(body).unwrap_or_default();
            assert_eq!(v["error"], code, "{r:?}");
        }
        // A good request over the same listener is served as before.
        let ok = tls_send(
            &connector,
            addr,
            b"GET /x HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n",
        )
        .await;
        assert!(ok.starts_with("HTTP/1.1 200 "), "{ok:?}");
    });
}

/// One handshake and one request on a new connection: the certificate the server presented.
async fn handshake_and_get(
    connector: &tokio_rustls::TlsConnector,
    addr: std::net::SocketAddr,
) -> Result<Vec<u8>, String> {
    let tcp = tokio::net::TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
    let mut tls = connector
        .connect(name, tcp)
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    let cert = tls
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| c.to_vec())
        .ok_or("no certificate")?;
    tls.write_all(b"GET /r HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        .await
        .map_err(|e| e.to_string())?;
    let mut buf = Vec::new();
    tls.read_to_end(&mut buf).await.map_err(|e| e.to_string())?;
    if !buf.starts_with(b"HTTP/1.1 200") {
        return Err(format!(
            "answer: {}",
            String::from_utf8_lossy(&buf[..buf.len().min(40)])
        ));
    }
    Ok(cert)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificate_rotation_under_load_has_no_failed_handshakes_and_a_bad_certificate_keeps_the_old_one() {
    let pki = Pki::new("rotation CA");
    let dir = tempfile::tempdir().unwrap();
    let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
    let (c1, k1) = pki.issue_pem(&["127.0.0.1"]);
    atomic_write(&cert, &c1);
    atomic_write(&key, &k1);
    let echo = echo().await;
    let gw = gateway(&format!("http://{echo}"), &tls_block(&cert, &key), OPEN_RULES, None).await;
    let addr = gw.addr();
    let first = cert_der(&cert).to_vec();

    let mut roots = rustls::RootCertStore::empty();
    roots.add(cert_der(&pki.ca_path())).unwrap();
    let mut cfg = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    // Full handshakes only: a resumed session reports the certificate of the first one.
    cfg.resumption = rustls::client::Resumption::disabled();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(cfg));
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let latest = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let errors = Arc::new(parking_lot::Mutex::new(Vec::<String>::new()));
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let (connector, stop, ok, failed, latest, errors) = (
            connector.clone(),
            stop.clone(),
            ok.clone(),
            failed.clone(),
            latest.clone(),
            errors.clone(),
        );
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                match handshake_and_get(&connector, addr).await {
                    Ok(c) => {
                        ok.fetch_add(1, Ordering::Relaxed);
                        *latest.lock() = c;
                    }
                    Err(e) => {
                        failed.fetch_add(1, Ordering::Relaxed);
                        errors.lock().push(e);
                    }
                }
            }
        }));
    }
    assert!(eventually(Duration::from_secs(10), || async { ok.load(Ordering::Relaxed) >= 50 }).await);
    assert_eq!(*latest.lock(), first);

    // Rotate: the new pair, written file by file (the watcher may see the new certificate
    // with the old key first: refused, the old pair serves on).
    let (c2, k2) = pki.issue_pem(&["127.0.0.1"]);
    atomic_write(&cert, &c2);
    atomic_write(&key, &k2);
    let second = cert_der(&cert).to_vec();
    assert_ne!(first, second);
    let rotated = eventually(Duration::from_secs(10), || async { *latest.lock() == second }).await;
    assert!(rotated, "the new certificate was never served");
    let after_rotation = ok.load(Ordering::Relaxed);

    // A broken certificate: refused and counted; the second one keeps serving.
    let c = client();
    let admin = gw.admin.clone();
    let errors_before = metric_value(&c, &admin, "tollgate_tls_certificate_reloads_total{result=\"error\"}").await;
    atomic_write(
        &cert,
        "-----BEGIN CERTIFICATE-----\nnot a certificate\n-----END CERTIFICATE-----\n",
    );
    let counted = eventually(Duration::from_secs(10), || async {
        metric_value(&c, &admin, "tollgate_tls_certificate_reloads_total{result=\"error\"}").await > errors_before
    })
    .await;
    assert!(counted, "the refused reload was not counted");
    let more = ok.load(Ordering::Relaxed) + 20;
    assert!(eventually(Duration::from_secs(10), || async { ok.load(Ordering::Relaxed) >= more }).await);
    assert_eq!(
        *latest.lock(),
        second,
        "a broken certificate must not replace the serving one"
    );

    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    assert!(after_rotation > 50);
    assert_eq!(
        failed.load(Ordering::Relaxed),
        0,
        "failed handshakes: {:?}",
        errors.lock()
    );
    assert!(metric_value(&c, &admin, "tollgate_tls_certificate_reloads_total{result=\"ok\"}").await >= 1.0);
}

/// Rules: 3 requests a minute on /limited, fail closed (a store failure is a 503, not a pass).
const LIMITED_RULES: &str = "rules:\n  - { name: limited, match: { path: /limited }, key: ip, algorithm: fixed_window, limit: 3, window: 1m, failure: closed }\n";

/// Three 200s then a 429: the store (not a fallback) counted.
async fn three_then_429(url: &str) {
    let c = client();
    for i in 0..3 {
        let r = c.get(format!("{url}/limited")).send().await.unwrap();
        assert_eq!(r.status(), 200, "request {i}: {}", r.text().await.unwrap());
    }
    assert_eq!(c.get(format!("{url}/limited")).send().await.unwrap().status(), 429);
}

/// `store:` for a TLS Redis with a password from `env`.
fn tls_store(kind: &str, urls: &[String], env: &str, ca: &Path) -> String {
    let urls: Vec<String> = urls.iter().map(|u| format!("\"{u}\"")).collect();
    format!(
        "store:\n  kind: {kind}\n  urls: [{}]\n  timeout: 250ms\n  password_env: {env}\n  tls: {{ ca_file: {} }}\n",
        urls.join(", "),
        ca.display()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_redis_with_a_password_standalone() {
    let redis = TlsRedis::start("s3cret-standalone");
    std::env::set_var("TOLLGATE_TEST_TLS_REDIS_PW", "s3cret-standalone");
    let echo = echo().await;
    let up = format!("http://{echo}");
    let store = tls_store(
        "redis",
        &[redis.url()],
        "TOLLGATE_TEST_TLS_REDIS_PW",
        &redis.pki.ca_path(),
    );
    let gw = gateway(&up, &store, LIMITED_RULES, None).await;
    three_then_429(&gw.url).await;
    let keys: u64 = redis.cli(&["DBSIZE"]).parse().unwrap();
    assert!(keys >= 1, "the counter lives in the TLS Redis");

    // The wrong password: the store refuses, the fail-closed rule answers 503.
    std::env::set_var("TOLLGATE_TEST_TLS_REDIS_PW_WRONG", "not-it");
    let store = tls_store(
        "redis",
        &[redis.url()],
        "TOLLGATE_TEST_TLS_REDIS_PW_WRONG",
        &redis.pki.ca_path(),
    );
    let gw = gateway(&up, &store, LIMITED_RULES, None).await;
    assert_eq!(
        client()
            .get(format!("{}/limited", gw.url))
            .send()
            .await
            .unwrap()
            .status(),
        503
    );

    // An unset password variable refuses to start, naming the line.
    let dir = tempfile::tempdir().unwrap();
    let store = tls_store(
        "redis",
        &[redis.url()],
        "TOLLGATE_TEST_TLS_REDIS_PW_UNSET",
        &redis.pki.ca_path(),
    );
    let p = write_config(dir.path(), &up, &store, LIMITED_RULES, None);
    let e = tollgate::config::GatewayConfig::load(&p, &Default::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("gateway.yaml:") && e.contains("TOLLGATE_TEST_TLS_REDIS_PW_UNSET is not set"),
        "{e}"
    );
    assert!(!e.contains("s3cret"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_redis_cluster_with_a_password() {
    let cluster = TlsRedisCluster::start("s3cret-cluster");
    std::env::set_var("TOLLGATE_TEST_TLS_CLUSTER_PW", "s3cret-cluster");
    let echo = echo().await;
    let store = tls_store(
        "redis_cluster",
        &cluster.seed_urls()[..2],
        "TOLLGATE_TEST_TLS_CLUSTER_PW",
        &cluster.pki.ca_path(),
    );
    let gw = gateway(&format!("http://{echo}"), &store, LIMITED_RULES, None).await;
    three_then_429(&gw.url).await;
    let total: u64 = cluster
        .ports
        .iter()
        .map(|&p| cluster.cli(p, &["DBSIZE"]).parse::<u64>().unwrap_or(0))
        .sum();
    assert!(total >= 1, "the counter lives in the TLS cluster");
}

/// The access line says which TLS version each request came over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_access_line_names_the_tls_version() {
    let pki = Pki::new("gateway CA");
    let (cert, key) = pki.issue("gw", &["localhost", "127.0.0.1"]);
    let echo = echo().await;
    let gw = binary(
        &format!("http://{echo}"),
        &format!("{}access_log: true\n", tls_block(&cert, &key)),
        OPEN_RULES,
    );
    let base = gw.url.replace("http://", "https://");
    let ca = pki.ca_path().display().to_string();
    for (flags, path) in [
        (["--tlsv1.2", "--tls-max", "1.2"], "/v12"),
        (["--tlsv1.3", "--http1.1", "-v"], "/v13"),
    ] {
        let mut args: Vec<String> = flags.iter().map(|s| s.to_string()).collect();
        args.extend([
            "--cacert".into(),
            ca.clone(),
            "-o".into(),
            "/dev/null".into(),
            format!("{base}{path}"),
        ]);
        let (ok, out) = curl(args).await;
        assert!(ok, "curl: {out}");
    }
    let tls_of = |path: &str| {
        gw.log()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .find(|v| v["target"] == "access" && v["path"] == path)
            .map(|v| v["tls"].clone())
    };
    let both = eventually(Duration::from_secs(5), || async {
        tls_of("/v12").is_some() && tls_of("/v13").is_some()
    })
    .await;
    assert!(both, "{}", gw.log());
    assert_eq!(tls_of("/v12"), Some(serde_json::json!("TLSv1.2")));
    assert_eq!(tls_of("/v13"), Some(serde_json::json!("TLSv1.3")));
}

/// The certificate's expiry is a gauge, and `tollgate check` warns on an expired certificate
/// (and on one that expires within 14 days).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificate_expiry_is_a_gauge_and_check_warns_before_it() {
    let pki = Pki::new("gateway CA");
    let (cert, key) = pki.issue_until("gw", &["localhost", "127.0.0.1"], (2030, 1, 2));
    let echo = echo().await;
    let gw = binary(&format!("http://{echo}"), &tls_block(&cert, &key), OPEN_RULES);
    let m = get_text(&client(), format!("{}/metrics", gw.admin)).await;
    // 2030-01-02T00:00:00Z
    assert_eq!(
        metric(&m, "tollgate_tls_certificate_expiry_timestamp_seconds").as_deref(),
        Some("1893542400"),
        "{m}"
    );
    // An expired certificate: `check` says so (and still passes: it is a warning).
    let (old_c, old_k) = pki.issue_until("old", &["localhost"], (2021, 6, 1));
    let dir = tempfile::tempdir().unwrap();
    let p = write_config(
        dir.path(),
        &format!("http://{echo}"),
        &tls_block(&old_c, &old_k),
        OPEN_RULES,
        None,
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_tollgate"))
        .args(["check", "--config"])
        .arg(&p)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("EXPIRED at 2021-06-01T00:00:00Z"), "{text}");
}
