//! `tollgate demo`: an embedded echo upstream plus the gateway on the memory store with
//! `config/demo/*.yaml`. The echo server is also the real upstream the end-to-end tests use.
//!
//! Echo behaviour: `GET`/`HEAD`/`DELETE`/`OPTIONS` answer JSON `{method, path, query, headers}`;
//! other methods stream the request body back. `/slow/<ms>` waits before answering,
//! `/status/<code>` answers that status, and an `Upgrade` request is accepted (101) and echoes
//! bytes over the upgraded connection.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::json;
use tokio::net::TcpListener;

use crate::config::{EnvOverrides, GatewayConfig};
use crate::http::{full, BoxError, ProxyBody};

/// The echo handler: the request as JSON (bodyless methods) or its body streamed back;
/// `/status/<code>` answers that status; upgrades are echoed.
pub async fn echo(mut req: Request<Incoming>) -> Result<Response<ProxyBody>, Infallible> {
    let path = req.uri().path().to_string();
    if let Some(ms) = path.strip_prefix("/slow/").and_then(|s| s.parse::<u64>().ok()) {
        tokio::time::sleep(Duration::from_millis(ms.min(60_000))).await;
    }
    if req.headers().contains_key(header::UPGRADE) {
        let up = hyper::upgrade::on(&mut req);
        tokio::spawn(async move {
            if let Ok(u) = up.await {
                let (mut r, mut w) = tokio::io::split(TokioIo::new(u));
                let _ = tokio::io::copy(&mut r, &mut w).await;
            }
        });
        let mut resp = Response::new(full(""));
        *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
        resp.headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
        let proto = req
            .headers()
            .get(header::UPGRADE)
            .cloned()
            .unwrap_or(HeaderValue::from_static("echo"));
        resp.headers_mut().insert(header::UPGRADE, proto);
        return Ok(resp);
    }
    let status = path
        .strip_prefix("/status/")
        .and_then(|s| s.parse::<u16>().ok())
        .and_then(|c| StatusCode::from_u16(c).ok())
        .unwrap_or(StatusCode::OK);
    let headers: serde_json::Map<String, serde_json::Value> = req
        .headers()
        .iter()
        .map(|(k, v)| (k.to_string(), json!(String::from_utf8_lossy(v.as_bytes()))))
        .collect();
    let info = json!({
        "method": req.method().as_str(),
        "path": path,
        "query": req.uri().query(),
        "headers": headers,
    });
    let bodyless = matches!(
        *req.method(),
        Method::GET | Method::HEAD | Method::DELETE | Method::OPTIONS
    );
    let mut resp = if bodyless {
        let mut r = Response::new(full(info.to_string()));
        r.headers_mut()
            .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        r
    } else {
        let body = ProxyBody::boxed(req.into_body().map_err(|e| -> BoxError { Box::new(e) }));
        let mut r = Response::new(body);
        r.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/octet-stream"),
        );
        r
    };
    *resp.status_mut() = status;
    resp.headers_mut().insert("x-echo", HeaderValue::from_static("1"));
    // A hop-by-hop header the gateway must strip on the way back.
    resp.headers_mut()
        .insert("keep-alive", HeaderValue::from_static("timeout=30"));
    Ok(resp)
}

/// Serve the echo upstream on `listener` until the task is dropped.
pub async fn serve_echo(listener: TcpListener) {
    loop {
        let (stream, _) = crate::http::accept(&listener).await;
        tokio::spawn(async move {
            let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                .serve_connection_with_upgrades(TokioIo::new(stream), service_fn(echo))
                .await;
        });
    }
}

/// Start the echo upstream on a free loopback port.
pub async fn start_echo() -> std::io::Result<SocketAddr> {
    let l = TcpListener::bind("127.0.0.1:0").await?;
    let addr = l.local_addr()?;
    tokio::spawn(serve_echo(l));
    Ok(addr)
}

/// The demo config built into the binary (`config/demo/`), so `tollgate demo` works from any
/// directory.
const DEMO_FILES: [(&str, &str); 3] = [
    ("gateway.yaml", include_str!("../config/demo/gateway.yaml")),
    ("rules.yaml", include_str!("../config/demo/rules.yaml")),
    ("keys.yaml", include_str!("../config/demo/keys.yaml")),
];

/// Write the built-in demo config into a fresh directory under the system temp dir; returns
/// the gateway file's path.
fn write_demo_config() -> std::io::Result<std::path::PathBuf> {
    let dir = std::env::temp_dir().join(format!("tollgate-demo-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    for (name, text) in DEMO_FILES {
        std::fs::write(dir.join(name), text)?;
    }
    Ok(dir.join("gateway.yaml"))
}

/// Run the demo until Ctrl-C / SIGTERM: the built-in config unless `config_path` is given,
/// with optional listen addresses (the admin one must be loopback: the demo has no token).
pub async fn run(
    config_path: Option<&Path>,
    listen: Option<SocketAddr>,
    admin_listen: Option<SocketAddr>,
) -> Result<(), Box<dyn std::error::Error>> {
    let (config_path, written) = match config_path {
        Some(p) => (p.to_path_buf(), false),
        None => (write_demo_config()?, true),
    };
    let result = run_with(&config_path, listen, admin_listen).await;
    if written {
        if let Some(dir) = config_path.parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
    result
}

async fn run_with(
    config_path: &Path,
    listen: Option<SocketAddr>,
    admin_listen: Option<SocketAddr>,
) -> Result<(), Box<dyn std::error::Error>> {
    let echo = start_echo().await?;
    let mut config = GatewayConfig::load(config_path, &EnvOverrides::from_env())?;
    if let Some(l) = listen {
        config.listen = l;
    }
    if let Some(a) = admin_listen {
        if !a.ip().is_loopback() && !config.admin.has_token() {
            return Err(format!("demo: --admin-listen {a} is not loopback and the demo admin API has no token").into());
        }
        config.admin_listen = a;
    }
    config.upstream.url = format!("http://{echo}").parse()?;
    config.upstream.authority = echo.to_string().parse()?;
    config.upstream.targets = vec![crate::config::Target::plain(echo)];
    let running = crate::server::start(config).await?;
    let a = running.addr;
    let port = a.port();
    println!(
        "tollgate demo: echo upstream on {echo}, gateway on http://{a} (memory store), admin on http://{}",
        running.admin_addr
    );
    println!(
        "Dashboard: http://{}/  (live: store, rules and reloads, traffic per rule, most limited hashes)",
        running.admin_addr
    );
    println!();
    println!("Try:");
    println!("  for i in $(seq 1 15); do curl -s -o /dev/null -w '%{{http_code}}\\n' localhost:{port}/; done   # anonymous: 10/min per IP, then 429");
    println!("  curl -i localhost:{port}/                                   # rate-limit headers on every response");
    println!(
        "  curl -i -H 'X-API-Key: demo-pro-key' localhost:{port}/api/search   # a registered pro key: higher limits"
    );
    println!("  curl -i -X POST localhost:{port}/api/login                   # 3 per minute per IP, fails closed");
    println!(
        "  curl -s localhost:{}/rules ; curl -s localhost:{}/metrics | grep tollgate_requests",
        running.admin_addr.port(),
        running.admin_addr.port()
    );
    println!(
        "  cargo run --release -- explain --config {} --method GET --path /api/search",
        config_path.display()
    );
    println!();
    println!("Ctrl-C to stop.");
    shutdown_signal().await;
    running.stop().await;
    Ok(())
}

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}
