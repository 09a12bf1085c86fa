//! Adaptive concurrency on the real binary, in front of an upstream written here: 8 service
//! slots and 5 ms of service time (it sleeps, so the test is fair on 2 cores), counting what
//! it has in flight, queued or served. Load is offered open-loop (a fixed rate, whatever the
//! answers), with the class in the path: `/critical/…`, `/api/…` (default), `/batch/…`
//! (sheddable), each picked by a rule's `priority`.

mod support;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::rt::{TokioExecutor, TokioIo};
use support::*;
use tokio::sync::{Mutex, Semaphore};

const SLOTS: usize = 8;

/// The load tests run one at a time: each needs the machine's two cores to itself.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
const SERVICE: Duration = Duration::from_millis(5);
/// Requests a second the upstream can serve.
const CAPACITY: f64 = SLOTS as f64 / 0.005;

/// The upstream: `SLOTS` servers of `SERVICE` each (FIFO beyond them); `/slow/<ms>` serves for
/// `<ms>` instead. Counts the requests inside it (waiting or served) now and at most.
struct Service {
    url: String,
    slots: Arc<Semaphore>,
    /// Permits taken away to lower the capacity.
    taken: Mutex<Vec<tokio::sync::OwnedSemaphorePermit>>,
    inside: Arc<AtomicUsize>,
    most_inside: Arc<AtomicUsize>,
}

impl Service {
    async fn start() -> Service {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        let slots = Arc::new(Semaphore::new(SLOTS));
        let inside = Arc::new(AtomicUsize::new(0));
        let most_inside = Arc::new(AtomicUsize::new(0));
        let (s, i, m) = (slots.clone(), inside.clone(), most_inside.clone());
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = l.accept().await else { continue };
                let (s, i, m) = (s.clone(), i.clone(), m.clone());
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                        let (s, i, m) = (s.clone(), i.clone(), m.clone());
                        async move {
                            let path = req.uri().path();
                            let work = path
                                .find("/slow/")
                                .and_then(|at| path[at + 6..].parse().ok())
                                .map_or(SERVICE, Duration::from_millis);
                            // Like a WSGI worker, the work goes on whatever happens to the
                            // connection (counted all that time).
                            let (tx, rx) = tokio::sync::oneshot::channel();
                            tokio::spawn(async move {
                                let now = i.fetch_add(1, Ordering::SeqCst) + 1;
                                m.fetch_max(now, Ordering::SeqCst);
                                let permit = s.acquire().await;
                                // A thread's sleep: within tens of microseconds, where a tokio
                                // timer rounds up to its next millisecond tick.
                                let _ = tokio::task::spawn_blocking(move || std::thread::sleep(work)).await;
                                drop(permit);
                                i.fetch_sub(1, Ordering::SeqCst);
                                let _ = tx.send(());
                            });
                            let _ = rx.await;
                            Ok::<_, std::convert::Infallible>(hyper::Response::new(Full::new(Bytes::from_static(
                                b"ok",
                            ))))
                        }
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Service {
            url,
            slots,
            taken: Mutex::new(Vec::new()),
            inside,
            most_inside,
        }
    }

    /// Serve with `n` slots from now on (at most `SLOTS`).
    async fn set_slots(&self, n: usize) {
        let mut taken = self.taken.lock().await;
        while SLOTS - taken.len() > n {
            taken.push(self.slots.clone().acquire_owned().await.unwrap());
        }
        while SLOTS - taken.len() < n {
            taken.pop();
        }
    }

    fn most_inside(&self) -> usize {
        self.most_inside.load(Ordering::SeqCst)
    }

    fn reset_most(&self) {
        self.most_inside
            .store(self.inside.load(Ordering::SeqCst), Ordering::SeqCst);
    }
}

const RULES: &str = r#"rules:
  - { name: critical, match: { path: "/critical/**" }, key: global, algorithm: fixed_window, limit: 1000000000, window: 1h, priority: critical }
  - { name: batch, match: { path: "/batch/**" }, key: global, algorithm: fixed_window, limit: 1000000000, window: 1h, priority: sheddable }
  - { name: api, match: { path: "/**" }, key: global, algorithm: fixed_window, limit: 1000000000, window: 1h }
"#;

/// The binary in front of `upstream` with `adaptive` (YAML lines under `upstream.adaptive`).
fn gateway(upstream: &str, adaptive: &str) -> BinaryGateway {
    let dir = tempfile::tempdir().unwrap();
    let (port, admin) = (free_port(), free_port());
    std::fs::write(dir.path().join("rules.yaml"), RULES).unwrap();
    let indented: String = adaptive.lines().map(|l| format!("    {l}\n")).collect();
    let gw = format!(
        "listen: 127.0.0.1:{port}\nadmin_listen: 127.0.0.1:{admin}\nupstream:\n  url: {upstream}\n  request_timeout: 5s\n  adaptive:\n{indented}rules_file: rules.yaml\nstore:\n  kind: memory\nserver:\n  max_connections: 10000\n  max_connections_per_ip: 2000\n"
    );
    let p = dir.path().join("gateway.yaml");
    std::fs::write(&p, gw).unwrap();
    // TOLLGATE_BIN runs these tests against another build (a release one, say).
    let bin = std::env::var("TOLLGATE_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_tollgate").to_owned());
    let mut cmd = std::process::Command::new(bin);
    cmd.args(["run", "--config"]).arg(&p).env("RUST_LOG", "warn");
    let g = BinaryGateway::spawn(&mut cmd, dir.path().join("tollgate.log"), &[port, admin]);
    std::mem::forget(dir);
    g
}

/// The adaptive settings of these tests: a 5 ms upstream needs no longer window.
const ADAPTIVE: &str = "initial: 10\nmin: 2\nmax: 200\n";

/// One request's outcome.
#[derive(Debug, Clone, Copy)]
struct Outcome {
    class: usize,
    status: u16,
    latency: Duration,
    /// Seconds since the load began.
    at: f64,
}

/// Offer `rate` requests a second for `secs`, open-loop, class `k` with probability
/// `mix[k]` (critical, default, sheddable); every outcome. The client is a lean HTTP/1.1 one
/// (keep-alive connections from a pool, the status line and `Content-Length` read, nothing
/// else), so that offering three times the upstream's capacity leaves the cores to the
/// gateway and the upstream rather than to the client.
async fn offer(url: &str, rate: f64, secs: f64, mix: [f64; 3]) -> Vec<Outcome> {
    let addr: std::net::SocketAddr = url.trim_start_matches("http://").parse().unwrap();
    let pool: Arc<std::sync::Mutex<Vec<tokio::net::TcpStream>>> = Arc::default();
    let out = Arc::new(std::sync::Mutex::new(Vec::new()));
    // The requests are paced by a thread of their own (a thread's sleep is good to tens of
    // microseconds; tokio's timers tick every millisecond, which would send them in bursts).
    let handle = tokio::runtime::Handle::current();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let results = out.clone();
    let pacer = std::thread::spawn(move || {
        let out = results;
        let start = Instant::now();
        let mut n = 0u64;
        let mut i = 0u64;
        loop {
            let due = start + Duration::from_secs_f64(i as f64 / rate);
            if due.duration_since(start).as_secs_f64() >= secs {
                break;
            }
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            i += 1;
            n = n.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let r = (n >> 11) as f64 / (1u64 << 53) as f64;
            let class = if r < mix[0] {
                0
            } else if r < mix[0] + mix[1] {
                1
            } else {
                2
            };
            let path = ["/critical/x", "/api/x", "/batch/x"][class];
            let (pool, out) = (pool.clone(), out.clone());
            let task = handle.spawn(async move {
                let t = Instant::now();
                let at = t.duration_since(start).as_secs_f64();
                let conn = pool.lock().unwrap().pop();
                let conn = match conn {
                    Some(c) => Ok(c),
                    None => tokio::net::TcpStream::connect(addr).await,
                };
                let status = match conn {
                    Ok(mut c) => match exchange(&mut c, path).await {
                        Ok(s) => {
                            pool.lock().unwrap().push(c);
                            s
                        }
                        Err(_) => 0,
                    },
                    Err(_) => 0,
                };
                out.lock().unwrap().push(Outcome {
                    class,
                    status,
                    latency: t.elapsed(),
                    at,
                });
            });
            if tx.send(task).is_err() {
                break;
            }
        }
    });
    while let Some(task) = rx.recv().await {
        let _ = task.await;
    }
    let _ = pacer.join();
    let v = out.lock().unwrap().clone();
    v
}

/// One `GET path` on a keep-alive connection: the response's status (its body read and
/// dropped).
async fn exchange(c: &mut tokio::net::TcpStream, path: &str) -> std::io::Result<u16> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    c.write_all(format!("GET {path} HTTP/1.1\r\nHost: test\r\n\r\n").as_bytes())
        .await?;
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        let k = c.read(&mut chunk).await?;
        if k == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        buf.extend_from_slice(&chunk[..k]);
        if let Some(at) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break at + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..head_end]).to_ascii_lowercase();
    let status = head.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0);
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0);
    let mut have = buf.len() - head_end;
    while have < len {
        let k = c.read(&mut chunk).await?;
        if k == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        have += k;
    }
    Ok(status)
}

fn percentile(mut v: Vec<Duration>, p: f64) -> Duration {
    v.sort();
    v.get(((v.len() as f64 - 1.0) * p).round() as usize)
        .copied()
        .unwrap_or_default()
}

/// The unloaded median latency through the gateway: one request at a time.
async fn unloaded_p50(url: &str) -> Duration {
    let c = client();
    let mut v = Vec::new();
    for _ in 0..100 {
        let t = Instant::now();
        let r = c.get(format!("{url}/api/x")).send().await.unwrap();
        assert_eq!(r.status(), 200);
        let _ = r.bytes().await;
        v.push(t.elapsed());
    }
    percentile(v, 0.5)
}

async fn limit_now(admin: &str) -> f64 {
    metric_value(&client(), admin, "tollgate_adaptive_limit").await
}

/// Sample the limit every 100 ms until `stop`.
fn watch_limit(admin: String, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<Vec<(f64, f64)>> {
    tokio::spawn(async move {
        let start = Instant::now();
        let mut v = Vec::new();
        while !stop.load(Ordering::SeqCst) {
            v.push((start.elapsed().as_secs_f64(), limit_now(&admin).await));
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        v
    })
}

fn share_ok(v: &[Outcome], class: usize) -> (usize, usize) {
    let of: Vec<&Outcome> = v.iter().filter(|o| o.class == class).collect();
    (of.iter().filter(|o| o.status == 200).count(), of.len())
}

/// What one run at three times capacity measured.
struct Run {
    unloaded_p50: Duration,
    /// Outcomes after the first second (the limit has settled).
    settled: Vec<Outcome>,
    most_inside: usize,
}

impl Run {
    fn admitted_p99(&self) -> Duration {
        percentile(
            self.settled
                .iter()
                .filter(|o| o.status == 200)
                .map(|o| o.latency)
                .collect(),
            0.99,
        )
    }
}

/// A fresh upstream and gateway (`adaptive` settings), the unloaded median, then three times
/// the upstream's capacity for 6 s: a twentieth critical, the rest default and sheddable.
async fn three_times(adaptive: &str) -> Run {
    let up = Service::start().await;
    let gw = gateway(&up.url, adaptive);
    let unloaded_p50 = unloaded_p50(&gw.url).await;
    up.reset_most();
    let cpu0 = cpu_ticks(gw.child.id());
    let v = offer(&gw.url, 3.0 * CAPACITY, 6.0, [0.05, 0.45, 0.5]).await;
    let cpu = cpu_ticks(gw.child.id()) - cpu0;
    let st = get_json(&client(), format!("{}/status", gw.admin)).await;
    let settled: Vec<Outcome> = v.iter().copied().filter(|o| o.at >= 1.0).collect();
    eprintln!(
        "{adaptive:?}: tollgate CPU {:.0} us/request over {} requests; unloaded p50 {unloaded_p50:?}; limit {}, baseline {} ms",
        cpu as f64 * 10_000.0 / v.len() as f64,
        v.len(),
        st["adaptive"]["limit"],
        st["adaptive"]["baseline_ms"],
    );
    for k in 0..3 {
        let l: Vec<Duration> = settled
            .iter()
            .filter(|o| o.status == 200 && o.class == k)
            .map(|o| o.latency)
            .collect();
        eprintln!(
            "  class {k}: admitted {} (p50 {:?}, p99 {:?}), refused {}",
            l.len(),
            percentile(l.clone(), 0.5),
            percentile(l.clone(), 0.99),
            settled.iter().filter(|o| o.status != 200 && o.class == k).count(),
        );
    }
    Run {
        unloaded_p50,
        settled,
        most_inside: up.most_inside(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_times_capacity_keeps_critical_served_latency_low_and_the_upstream_within_bound() {
    let _serial = SERIAL.lock().await;
    // The reference: a fixed limit at the upstream's slot count, which only an operator who
    // knew the capacity could set.
    let fixed = three_times("min: 8\nmax: 8\ninitial: 8\n").await;
    let run = three_times(ADAPTIVE).await;
    let settled = &run.settled;
    let (ok, all) = share_ok(settled, 0);
    assert!(all > 1000, "{all} critical requests offered");
    // 99.9 % of critical requests succeed, unless the machine cannot carry the load at all:
    // when even the fixed limit at the upstream's capacity serves critical requests less often
    // (a loaded CI machine, the gateway itself out of CPU), the adaptive limit must do at
    // least as well as it.
    let (fixed_ok, fixed_all) = share_ok(&fixed.settled, 0);
    let (rate, fixed_rate) = (ok as f64 / all as f64, fixed_ok as f64 / fixed_all.max(1) as f64);
    assert!(
        rate >= 0.999 || (fixed_rate < 0.999 && rate >= fixed_rate),
        "critical: {ok} of {all} succeeded (the fixed limit: {fixed_ok} of {fixed_all}); statuses {:?}",
        statuses(settled, 0)
    );
    // Admitted requests' p99 within twice the unloaded median or, where this machine's own
    // jitter puts even the fixed limit at the upstream's capacity past that (it does on 2
    // shared cores: about 2.0-2.2 times), within a fifth of that fixed limit's p99.
    let (p99, fixed_p99) = (run.admitted_p99(), fixed.admitted_p99());
    let bound = (2 * run.unloaded_p50).max(fixed_p99.mul_f64(1.2));
    assert!(
        p99 <= bound,
        "admitted p99 {p99:?}: unloaded p50 {:?}, the fixed limit's p99 {fixed_p99:?}",
        run.unloaded_p50
    );
    // Refused requests are 503s naming their class, sheddable first.
    let (shed_ok, shed_all) = share_ok(settled, 2);
    let (def_ok, def_all) = share_ok(settled, 1);
    assert!(
        (shed_ok as f64 / shed_all as f64) <= (def_ok as f64 / def_all as f64) + 0.02,
        "sheddable {shed_ok}/{shed_all} against default {def_ok}/{def_all}"
    );
    assert!(
        settled.iter().all(|o| matches!(o.status, 200 | 503)),
        "{:?}",
        statuses(settled, 1)
    );
    // The adaptive limit serves at least 85 % of what the fixed one did.
    let served = |r: &Run| r.settled.iter().filter(|o| o.status == 200).count() as f64;
    assert!(
        served(&run) >= 0.85 * served(&fixed),
        "served {} against {}",
        served(&run),
        served(&fixed)
    );
    // The stated bound (docs/adaptive.md): slots × (tolerance + (tolerance − 1) × overhead /
    // service) plus one window's growth, or the initial limit if that is more: 14 here.
    assert!(run.most_inside <= 14, "the upstream held {} at once", run.most_inside);
}

fn statuses(v: &[Outcome], class: usize) -> std::collections::BTreeMap<u16, usize> {
    let mut m = std::collections::BTreeMap::new();
    for o in v.iter().filter(|o| o.class == class) {
        *m.entry(o.status).or_insert(0) += 1;
    }
    m
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_is_a_503_with_retry_after_naming_the_class_and_unavailable_for_grpc() {
    let _serial = SERIAL.lock().await;
    let up = Service::start().await;
    // One slot, no queue for anyone: a second request in flight is refused at once.
    let gw = gateway(
        &up.url,
        "min: 1\nmax: 1\ninitial: 1\nclasses: [{name: critical}, {name: default, queue_timeout: 0s}, {name: sheddable, queue_timeout: 0s}]\n",
    );
    let c = client();
    let slow = {
        let (c, u) = (c.clone(), format!("{}/api/slow/1500", gw.url));
        tokio::spawn(async move { c.get(u).send().await.map(|r| r.status().as_u16()) })
    };
    let admin = gw.admin.clone();
    assert!(
        eventually(Duration::from_secs(5), || async {
            metric_value(&client(), &admin, "tollgate_adaptive_in_flight").await >= 1.0
        })
        .await
    );
    let r = c.get(format!("{}/batch/x", gw.url)).send().await.unwrap();
    assert_eq!(r.status(), 503);
    assert_eq!(r.headers()["retry-after"], "1");
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["error"], "overloaded");
    assert_eq!(body["class"], "sheddable");
    let r = c
        .post(format!("{}/api/x", gw.url))
        .header("content-type", "application/grpc")
        .send()
        .await
        .unwrap();
    assert_eq!(r.headers()["grpc-status"], "14", "{:?}", r.headers());
    assert!(r.headers()["grpc-message"].to_str().unwrap().contains("class default"));
    assert_eq!(slow.await.unwrap().unwrap(), 200);
    let m = get_text(&c, format!("{}/metrics", gw.admin)).await;
    assert_eq!(
        metric(
            &m,
            "tollgate_adaptive_requests_total{class=\"sheddable\",outcome=\"queue_full\"}"
        )
        .as_deref(),
        Some("1")
    );
    let st = get_json(&c, format!("{}/status", gw.admin)).await;
    assert_eq!(st["adaptive"]["classes"][2]["refused"], 1, "{st}");
    assert_eq!(st["adaptive"]["limit"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn halved_capacity_is_found_within_5s_and_recovered_when_it_returns() {
    let _serial = SERIAL.lock().await;
    let up = Service::start().await;
    let gw = gateway(&up.url, ADAPTIVE);
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = watch_limit(gw.admin.clone(), stop.clone());
    let url = gw.url.clone();
    let load = tokio::spawn(async move { offer(&url, 2.0 * CAPACITY, 15.0, [0.2, 0.4, 0.4]).await });
    tokio::time::sleep(Duration::from_secs(4)).await;
    let halved_at = 4.0;
    up.set_slots(SLOTS / 2).await;
    tokio::time::sleep(Duration::from_secs(6)).await;
    let restored_at = 10.0;
    up.set_slots(SLOTS).await;
    let _ = load.await.unwrap();
    stop.store(true, Ordering::SeqCst);
    let limits = watcher.await.unwrap();
    let window = |from: f64, to: f64| -> Vec<f64> {
        limits
            .iter()
            .filter(|(t, _)| *t >= from && *t < to)
            .map(|(_, l)| *l)
            .collect()
    };
    let before = window(2.0, halved_at);
    // Within 4 s of the halving the limit has re-converged: near half what it was (the
    // ratio of limit to slots depends on the machine's latency noise, so it is judged
    // against the limit the same run learned at full capacity), and within the bound the
    // moderate-overload test holds it to (2.5 × the slots).
    let halved = window(halved_at + 4.0, restored_at);
    let recovered = window(restored_at + 4.0, 15.0);
    let median = |mut v: Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    };
    let (b, h, r) = (
        median(before.clone()),
        median(halved.clone()),
        median(recovered.clone()),
    );
    assert!(
        h <= 0.6 * b && h <= 2.5 * (SLOTS / 2) as f64,
        "limit before {b} ({before:?}), halved {h} ({halved:?})"
    );
    assert!(r >= 8.0, "recovered to {r} ({recovered:?})");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn steady_load_under_capacity_is_never_refused() {
    let _serial = SERIAL.lock().await;
    let up = Service::start().await;
    let gw = gateway(&up.url, ADAPTIVE);
    let v = offer(&gw.url, 0.5 * CAPACITY, 6.0, [0.2, 0.4, 0.4]).await;
    let refused = v.iter().filter(|o| o.status != 200).count();
    assert_eq!(refused, 0, "{:?}", statuses(&v, 1));
    // No second's success rate dips by more than 1 %.
    for s in 0..6 {
        let sec: Vec<&Outcome> = v.iter().filter(|o| o.at as usize == s).collect();
        let ok = sec.iter().filter(|o| o.status == 200).count();
        assert!(
            ok as f64 >= 0.99 * sec.len() as f64,
            "second {s}: {ok} of {}",
            sec.len()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moderate_overload_does_not_grow_the_limit_and_one_slow_request_does_not_halve_it() {
    let _serial = SERIAL.lock().await;
    let up = Service::start().await;
    let gw = gateway(&up.url, ADAPTIVE);
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = watch_limit(gw.admin.clone(), stop.clone());
    // 1.3 × capacity for 8 s.
    let v = offer(&gw.url, 1.3 * CAPACITY, 8.0, [0.0, 1.0, 0.0]).await;
    stop.store(true, Ordering::SeqCst);
    let limits = watcher.await.unwrap();
    // Bounded (the load starts cold, so the first baseline is learned under it: at most
    // 2.5 × the slots), and no upward trend: the last two seconds sit no higher than seconds
    // two to four.
    let most = limits.iter().map(|(_, l)| *l).fold(0.0, f64::max);
    assert!(most <= 20.0, "the limit grew to {most}: {limits:?}");
    let median = |from: f64, to: f64| {
        let mut v: Vec<f64> = limits
            .iter()
            .filter(|(t, _)| *t >= from && *t < to)
            .map(|(_, l)| *l)
            .collect();
        v.sort_by(|a, b| a.total_cmp(b));
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    };
    let (early, late) = (median(2.0, 4.0), median(6.0, 8.0));
    assert!(late <= early + 2.0, "the limit climbs: {early} then {late}: {limits:?}");
    assert!(v.iter().filter(|o| o.status == 200).count() > 1000);

    // Under steady load below capacity, one request that takes 400 ms does not halve the limit.
    let url = gw.url.clone();
    let load = tokio::spawn(async move { offer(&url, 0.6 * CAPACITY, 4.0, [0.0, 1.0, 0.0]).await });
    tokio::time::sleep(Duration::from_secs(2)).await;
    let before = limit_now(&gw.admin).await;
    let r = client().get(format!("{}/api/slow/400", gw.url)).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let after = limit_now(&gw.admin).await;
    let _ = load.await;
    assert!(
        after >= before / 2.0 + 1.0,
        "limit went from {before} to {after} after one slow request"
    );
}

/// CPU time of process `pid` so far, in clock ticks (1/100 s).
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit(')').next().unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    f.get(11).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)
        + f.get(12).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0)
}

/// The hostile client: requests that reset their connection mid-flight, again and again, while
/// the upstream still works on them. Their room stays taken until the upstream answers, so the
/// upstream never holds more than the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_that_reset_mid_flight_never_free_room_the_upstream_still_uses() {
    let _serial = SERIAL.lock().await;
    let up = Service::start().await;
    let gw = gateway(&up.url, "min: 4\nmax: 4\ninitial: 4\nqueue_timeout: 1s\n");
    let addr: std::net::SocketAddr = gw.url.trim_start_matches("http://").parse().unwrap();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..16 {
        tasks.spawn(async move {
            use tokio::io::AsyncWriteExt;
            for _ in 0..5 {
                let mut c = tokio::net::TcpStream::connect(addr).await.unwrap();
                c.write_all(b"GET /api/slow/200 HTTP/1.1\r\nHost: test\r\n\r\n")
                    .await
                    .unwrap();
                tokio::time::sleep(Duration::from_millis(20)).await;
                // RST, not FIN.
                #[allow(deprecated)]
                c.set_linger(Some(Duration::ZERO)).unwrap();
                drop(c);
            }
        });
    }
    while tasks.join_next().await.is_some() {}
    let admin = gw.admin.clone();
    // Everything reached the upstream, or was refused, and all room came back.
    assert!(
        eventually(Duration::from_secs(10), || async {
            metric_value(&client(), &admin, "tollgate_adaptive_in_flight").await == 0.0
                && up.inside.load(Ordering::SeqCst) == 0
        })
        .await
    );
    assert!(
        up.most_inside() <= 4,
        "the upstream held {} at once under a limit of 4",
        up.most_inside()
    );
    assert!(
        up.most_inside() >= 3,
        "the test never filled the limit ({})",
        up.most_inside()
    );
}

/// `tollgate check` names the line and column of a `priority` that is not a class, of one
/// without `upstream.adaptive`, and of a bad adaptive setting; a good file passes.
#[test]
fn check_names_bad_priorities_and_settings_by_line_and_column() {
    let dir = tempfile::tempdir().unwrap();
    let write = |adaptive: &str, priority: &str| {
        std::fs::write(
            dir.path().join("rules.yaml"),
            format!("rules:\n  - name: a\n    match: {{ path: /x }}\n    key: ip\n    limit: 5\n    window: 1m\n    priority: {priority}\n"),
        )
        .unwrap();
        let p = dir.path().join("gateway.yaml");
        std::fs::write(
            &p,
            format!("upstream:\n  url: http://127.0.0.1:1\n{adaptive}rules_file: rules.yaml\n"),
        )
        .unwrap();
        tollgate_check(&p)
    };
    let (ok, out) = write("  adaptive: { min: 2 }\n", "critical");
    assert!(ok, "{out}");
    let (ok, out) = write("  adaptive: { min: 2 }\n", "gold");
    assert!(
        !ok && out.contains("rules.yaml:7:15") && out.contains("not one of upstream.adaptive.classes"),
        "{out}"
    );
    let (ok, out) = write("", "critical");
    assert!(
        !ok && out.contains("rules.yaml:7:15") && out.contains("needs upstream.adaptive"),
        "{out}"
    );
    let (ok, out) = write("  adaptive: { min: 2, max: 1 }\n", "critical");
    assert!(
        !ok && out.contains("gateway.yaml:3:") && out.contains("below min"),
        "{out}"
    );
}

/// The hostile client's second way: a streamed answer keeps the upstream busy after its head.
/// The room is held until the body ends, so the upstream never streams more answers at once
/// than the limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_answer_holds_its_room_until_its_body_ends() {
    let _serial = SERIAL.lock().await;
    let up = counting_upstream().await;
    // Classes without a guaranteed share: every one of the 4 slots may go to these requests
    // (with the default classes, critical keeps one of them).
    let gw = gateway(
        &up.url(),
        "min: 4\nmax: 4\ninitial: 4\nqueue_timeout: 5s\nclasses: [{name: critical}, {name: default}, {name: sheddable}]\n",
    );
    let c = client();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..12 {
        let (c, url) = (c.clone(), format!("{}/busy-stream/300/1", gw.url));
        tasks.spawn(async move {
            let r = c.get(url).send().await.unwrap();
            let status = r.status().as_u16();
            let _ = r.bytes().await;
            status
        });
    }
    let mut ok = 0;
    while let Some(s) = tasks.join_next().await {
        ok += usize::from(s.unwrap() == 200);
    }
    assert_eq!(ok, 12, "all were served, four at a time");
    assert!(
        up.max() <= 4,
        "the upstream streamed {} answers at once under a limit of 4",
        up.max()
    );
    assert_eq!(up.max(), 4);
}
