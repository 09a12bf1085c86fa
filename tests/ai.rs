//! Token budgets for AI APIs (docs/ai.md): the official `openai` Python package as the client
//! (`tests/support/ai_client.py`), through the real binary, to an OpenAI-compatible upstream
//! written for the test (`tests/support/ai_upstream.py`: the last user message scripts the usage
//! it reports, plain or streamed, and how it misbehaves), on real Redis (standalone, and the
//! 6-node cluster with three gateways).
//!
//! | what | test |
//! |---|---|
//! | usage in a JSON body and in the last event of a stream is charged; input, output, total and a request count on one rule; `qu="tokens"` | `usage_is_charged_from_plain_and_streamed_answers_on_every_budget` |
//! | 50 clients against 10,000 tokens a minute: never over (the estimate is an upper bound), ≥ 90 % used | `fifty_clients_against_10k_tokens_a_minute_on_redis`, `..._on_the_cluster_through_three_gateways` |
//! | an estimate below the real cost: overshoot ≤ in flight × (actual − estimate) | `an_estimate_below_the_cost_overshoots_at_most_in_flight_times_the_difference` |
//! | client gone mid-stream, upstream 500, no usage, 10 MB body, malformed JSON, awkward chunks | `failure_paths_are_charged_as_documented_and_nothing_leaks` |
//! | time to first byte is the same with and without the rule | `streaming_time_to_first_byte_is_the_same_with_and_without_the_rule` |

mod support;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};
use support::*;

/// The upstream script, killed on drop.
struct Upstream {
    child: Child,
    url: String,
    log: tempfile::NamedTempFile,
}

impl Upstream {
    fn start() -> Upstream {
        let log = tempfile::NamedTempFile::new().unwrap();
        let mut child = Command::new("python3")
            .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/support/ai_upstream.py"))
            .args(["--port", "0", "--log"])
            .arg(log.path())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("python3 runs tests/support/ai_upstream.py");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let port: u16 = line
            .trim()
            .strip_prefix("listening ")
            .and_then(|p| p.parse().ok())
            .unwrap_or_else(|| panic!("the upstream said {line:?}"));
        Upstream {
            child,
            url: format!("http://127.0.0.1:{port}"),
            log,
        }
    }

    /// The requests it answered, one JSON object each.
    fn answered(&self) -> Vec<Value> {
        std::fs::read_to_string(self.log.path())
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }
}

impl Drop for Upstream {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Run `ai_client.py` against the gateway at `base` with `args`: its records and its summary.
async fn client(base: &str, args: &[&str]) -> (Vec<Value>, Value) {
    let mut cmd = Command::new("python3");
    cmd.arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/support/ai_client.py"))
        .args(["--base-url", &format!("{base}/v1"), "--api-key", "sk-test-not-a-secret"])
        .args(args)
        .stdin(Stdio::null());
    let out = tokio::task::spawn_blocking(move || cmd.output())
        .await
        .unwrap()
        .expect("python3 runs tests/support/ai_client.py");
    assert!(
        out.status.success(),
        "ai_client.py {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut records = Vec::new();
    let mut summary = Value::Null;
    for l in String::from_utf8_lossy(&out.stdout).lines() {
        let v: Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"));
        match v.get("summary") {
            Some(s) => summary = s.clone(),
            None => records.push(v),
        }
    }
    (records, summary)
}

fn store(kind: &str, urls: &[String]) -> String {
    trusting_store_yaml(kind, urls, "")
}

/// One rule, four budgets on one request: requests, input tokens (200 reserved until the answer
/// says; at most 1,000 requests in flight per key), output tokens (reserved as `max_tokens`: an upper bound), and total tokens per
/// calendar month.
const BUDGETS: &str = r#"rules:
  - name: chat
    match: { path: /v1/chat/completions, methods: [POST] }
    key: ip
    algorithm: fixed_window
    failure: closed
    limits:
      - { limit: 100000, window: 1m }
      - { limit: 1000000, window: 1m, cost: 200, cost_from: { json: usage.prompt_tokens, max: 100000, in_flight: 1000 } }
      - { limit: 10000, window: 1m, cost_from: { json: usage.completion_tokens, max: 4096 }, estimate: { json: [max_tokens, max_completion_tokens], default: 4096 } }
      - { limit: 100000000, window: 1mo, cost_from: { json: usage.total_tokens, max: 104096 }, estimate: { json: max_tokens, default: 4096 } }
    align: calendar
"#;

/// The counter of `ip`'s limit with this window and limit, as `/keys` shows it.
async fn counter(c: &reqwest::Client, admin: &str, ip: &str, window: &str, limit: u64) -> Value {
    let v = get_json(c, format!("{admin}/keys/{ip}")).await;
    v["counters"]
        .as_array()
        .and_then(|a| a.iter().find(|k| k["window"] == window && k["limit"] == limit).cloned())
        .unwrap_or_else(|| panic!("no {limit}/{window} counter for {ip}: {v}"))
}

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a count: {v}"))
}

/// Sum of one usage field over the records that were answered 200 with usage.
fn usage_sum(records: &[Value], field: &str) -> u64 {
    records
        .iter()
        .filter(|r| r["status"] == 200)
        .filter_map(|r| r["usage"][field].as_u64())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_is_charged_from_plain_and_streamed_answers_on_every_budget() {
    let server = RedisServer::start();
    let up = Upstream::start();
    let gw = binary(&up.url, &store("redis", &[server.url()]), BUDGETS);
    let c = reqwest::Client::new();
    let plain = json!({"prompt_tokens": 120, "completion_tokens": 30}).to_string();
    let (r, _) = client(&gw.url, &["one", "--content", &plain, "--max-tokens", "100"]).await;
    assert_eq!(r[0]["status"], 200, "{r:?}");
    let streamed = json!({"prompt_tokens": 7, "completion_tokens": 45}).to_string();
    let (r, _) = client(
        &gw.url,
        &["one", "--content", &streamed, "--max-tokens", "60", "--stream"],
    )
    .await;
    assert_eq!(r[0]["status"], 200, "{r:?}");
    assert_eq!(r[0]["usage"]["total_tokens"], 52, "{r:?}");
    // Settled on every budget: requests 2, input 127, output 75, total 202; nothing reserved.
    let settled = eventually(Duration::from_secs(5), || async {
        let out = counter(&c, &gw.admin, "127.0.0.1", "1m", 10000).await;
        out["charged"] == 75 && out["reserved"] == 0
    })
    .await;
    let out = counter(&c, &gw.admin, "127.0.0.1", "1m", 10000).await;
    assert!(settled, "output tokens: {out}");
    assert_eq!(out["unit"], "tokens");
    let input = counter(&c, &gw.admin, "127.0.0.1", "1m", 1000000).await;
    assert_eq!((u(&input["charged"]), u(&input["reserved"])), (127, 0), "{input}");
    let total = counter(&c, &gw.admin, "127.0.0.1", "1mo", 100000000).await;
    assert_eq!((u(&total["charged"]), u(&total["reserved"])), (202, 0), "{total}");
    let requests = counter(&c, &gw.admin, "127.0.0.1", "1m", 100000).await;
    assert_eq!(100000 - u(&requests["remaining"]), 2, "{requests}");
    // The policy names the unit of the token budgets, and not of the request count.
    let resp = c
        .post(format!("{}/v1/chat/completions", gw.url))
        .json(&json!({"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "{\"completion_tokens\": 5}"}]}))
        .send()
        .await
        .unwrap();
    let policy = resp.headers()["ratelimit-policy"].to_str().unwrap().to_owned();
    assert!(
        policy.contains(";q=100000;w=60,") && policy.contains(";q=10000;w=60;qu=\"tokens\""),
        "{policy}"
    );
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["usage"]["completion_tokens"], 5);
    let metrics = get_text(&c, format!("{}/metrics", gw.admin)).await;
    let charged = eventually(Duration::from_secs(5), || async {
        let m = get_text(&c, format!("{}/metrics", gw.admin)).await;
        metric(
            &m,
            "tollgate_cost_charged_total{rule=\"chat\",source=\"json usage.completion_tokens\"}",
        )
        .as_deref()
            == Some("80")
    })
    .await;
    assert!(charged, "{metrics}");
}

/// Per window of 60 s (by the gateway's own `RateLimit` `t` on each answer): the completion
/// tokens of the requests it admitted, by window end (unix seconds).
fn per_window(records: &[Value]) -> std::collections::BTreeMap<u64, u64> {
    let mut out = std::collections::BTreeMap::new();
    for r in records.iter().filter(|r| r["status"] == 200) {
        let t_start = r["t_start"].as_f64().unwrap();
        // `"chat-3";r=…;t=…` or another budget's: every window here is the same minute.
        let rl = r["ratelimit"].as_str().unwrap_or_else(|| panic!("no RateLimit: {r}"));
        let t: f64 = rl
            .rsplit(";t=")
            .next()
            .and_then(|t| t.parse().ok())
            .unwrap_or_else(|| panic!("{rl}"));
        let end = ((t_start + t) / 60.0).round() as u64 * 60;
        *out.entry(end).or_insert(0) += r["usage"]["completion_tokens"].as_u64().unwrap_or(0);
    }
    out
}

/// Run `clients` openai clients against each of `gateways` until one whole minute window has
/// passed: what they were answered.
async fn load(gateways: &[String], clients: usize) -> Vec<Value> {
    let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs_f64();
    // Through the end of the next whole window, and 2 s into the one after. The clients take a
    // moment to start (a loaded CI machine has taken over a second): a window starting sooner
    // than 10 s from now may begin before the first request, so the whole one is the next.
    let mut to_boundary = 60.0 - now % 60.0;
    if to_boundary < 10.0 {
        to_boundary += 60.0;
    }
    let seconds = format!("{:.1}", to_boundary + 62.0);
    let n = clients.to_string();
    let runs = gateways.iter().enumerate().map(|(i, g)| {
        let (seconds, n, seed) = (seconds.clone(), n.clone(), (i + 1).to_string());
        async move {
            client(
                g,
                &[
                    "load",
                    "--clients",
                    &n,
                    "--seconds",
                    &seconds,
                    "--seed",
                    &seed,
                    "--min-max-tokens",
                    "20",
                    "--max-max-tokens",
                    "400",
                    "--sleep-after-failure-ms",
                    "200,400",
                ],
            )
            .await
            .0
        }
    });
    futures_util::future::join_all(runs)
        .await
        .into_iter()
        .flatten()
        .collect()
}

/// The load's verdict: every window at or under 10,000 completion tokens (the estimate,
/// `max_tokens`, bounds each request's: the stated bound is zero), every whole window at least
/// 90 % used, and the monthly total charged exactly what the answers reported.
async fn judge(records: &[Value], admin: &str) {
    let ok = records.iter().filter(|r| r["status"] == 200).count();
    let limited = records.iter().filter(|r| r["status"] == 429).count();
    let other: Vec<&Value> = records
        .iter()
        .filter(|r| r["status"] != 200 && r["status"] != 429)
        .take(3)
        .collect();
    assert!(other.is_empty(), "answers other than 200 and 429: {other:?}");
    let windows = per_window(records);
    println!("{ok} answered, {limited} limited; completion tokens per window: {windows:?}");
    for (end, tokens) in &windows {
        assert!(
            *tokens <= 10_000,
            "the window ending {end} charged {tokens} > 10000: {windows:?}"
        );
    }
    let first_start = records
        .iter()
        .filter_map(|r| r["t_start"].as_f64())
        .fold(f64::MAX, f64::min);
    let last_end = records.iter().filter_map(|r| r["t_end"].as_f64()).fold(0.0, f64::max);
    let whole: Vec<(&u64, &u64)> = windows
        .iter()
        .filter(|(end, _)| (**end as f64 - 60.0) >= first_start && (**end as f64) <= last_end)
        .collect();
    assert!(!whole.is_empty(), "no whole window in the run: {windows:?}");
    for (end, tokens) in whole {
        assert!(
            *tokens >= 9_000,
            "the whole window ending {end} used only {tokens} of 10000: {windows:?}"
        );
    }
    let c = reqwest::Client::new();
    let total = usage_sum(records, "total_tokens");
    let settled = eventually(Duration::from_secs(10), || async {
        let t = counter(&c, admin, "127.0.0.1", "1mo", 100000000).await;
        t["charged"] == total && t["reserved"] == 0
    })
    .await;
    let t = counter(&c, admin, "127.0.0.1", "1mo", 100000000).await;
    assert!(settled, "monthly total: {t}, answers reported {total}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_clients_against_10k_tokens_a_minute_on_redis() {
    let server = RedisServer::start();
    let up = Upstream::start();
    let gw = binary(&up.url, &store("redis", &[server.url()]), BUDGETS);
    let records = load(std::slice::from_ref(&gw.url), 50).await;
    judge(&records, &gw.admin).await;
    let c = reqwest::Client::new();
    let m = get_text(&c, format!("{}/metrics", gw.admin)).await;
    assert_eq!(
        metric(&m, "tollgate_cost_reservations_in_flight").as_deref(),
        Some("0"),
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_clients_against_10k_tokens_a_minute_on_the_cluster_through_three_gateways() {
    let cluster = RedisCluster::start();
    let up = Upstream::start();
    let st = store("redis_cluster", &cluster.seed_urls());
    let gws: Vec<BinaryGateway> = (0..3).map(|_| binary(&up.url, &st, BUDGETS)).collect();
    let urls: Vec<String> = gws.iter().map(|g| g.url.clone()).collect();
    let records = load(&urls, 17).await;
    judge(&records, &gws[0].admin).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_estimate_below_the_cost_overshoots_at_most_in_flight_times_the_difference() {
    // Total tokens reserved as `max_tokens` (20..60), but each answer also counts 100..200
    // prompt tokens: every request costs 100..200 more than it reserved. At most 5 in flight
    // per key: a window may be overshot by 5 × 200 at most.
    let rules = r#"rules:
  - name: total
    match: { path: /v1/chat/completions }
    key: ip
    algorithm: fixed_window
    limit: 3000
    window: 10s
    failure: closed
    cost_from: { json: usage.total_tokens, max: 1000, in_flight: 5 }
    estimate: { json: max_tokens, default: 1000 }
"#;
    let server = RedisServer::start();
    let up = Upstream::start();
    let gw = binary(&up.url, &store("redis", &[server.url()]), rules);
    let (records, _) = client(
        &gw.url,
        &[
            "load",
            "--clients",
            "20",
            "--seconds",
            "25",
            "--min-max-tokens",
            "20",
            "--max-max-tokens",
            "60",
            "--prompt-tokens-range",
            "100,200",
            "--extra",
            "{\"delay_ms\": 100}",
            "--sleep-after-failure-ms",
            "50,150",
        ],
    )
    .await;
    let statuses: std::collections::BTreeMap<String, usize> = records.iter().fold(Default::default(), |mut m, r| {
        *m.entry(r["status"].to_string()).or_default() += 1;
        m
    });
    println!("answers by status: {statuses:?}; first: {:?}", records.first());
    let mut windows = std::collections::BTreeMap::<u64, u64>::new();
    for r in records.iter().filter(|r| r["status"] == 200) {
        let rl = r["ratelimit"].as_str().unwrap();
        let t: f64 = rl.rsplit(";t=").next().and_then(|t| t.parse().ok()).unwrap();
        let end = ((r["t_start"].as_f64().unwrap() + t) / 10.0).round() as u64 * 10;
        *windows.entry(end).or_insert(0) += r["usage"]["total_tokens"].as_u64().unwrap();
    }
    println!("total tokens per 10 s window: {windows:?}");
    assert!(windows.len() >= 2, "{windows:?}");
    for (end, tokens) in &windows {
        assert!(
            *tokens <= 3000 + 5 * 200,
            "window ending {end}: {tokens} > limit + in_flight × (actual − estimate): {windows:?}"
        );
    }
    // It was overshot at all (the bound is not vacuous) and it was used.
    assert!(windows.values().any(|t| *t > 3000), "{windows:?}");
}

/// `/keys`' 1h total-token counter of 127.0.0.1: (charged, reserved).
async fn charged(c: &reqwest::Client, admin: &str) -> (u64, u64) {
    let v = counter(c, admin, "127.0.0.1", "1h", 10000000).await;
    (u(&v["charged"]), u(&v["reserved"]))
}

/// Polls until the charged total is `want` and nothing is reserved; panics with what it saw.
async fn charged_reaches(c: &reqwest::Client, admin: &str, want: u64, what: &str) {
    let ok = eventually(Duration::from_secs(10), || async {
        charged(c, admin).await == (want, 0)
    })
    .await;
    assert!(
        ok,
        "{what}: charged and reserved {:?}, want ({want}, 0)",
        charged(c, admin).await
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failure_paths_are_charged_as_documented_and_nothing_leaks() {
    // Reserved: `max_tokens`; settled: total tokens; only 2xx and 4xx answers spend.
    let rules = r#"rules:
  - name: total
    match: { path: /v1/chat/completions }
    key: ip
    algorithm: fixed_window
    limit: 10000000
    window: 1h
    failure: closed
    count_when: { status: [2xx, 4xx] }
    cost_from: { json: usage.total_tokens, max: 200000 }
    estimate: { json: max_tokens, default: 5000 }
"#;
    let server = RedisServer::start();
    let up = Upstream::start();
    let gw = binary(&up.url, &store("redis", &[server.url()]), rules);
    let c = reqwest::Client::new();
    let one = |content: Value, extra: &'static [&'static str]| {
        let url = gw.url.clone();
        async move {
            let content = content.to_string();
            let mut args = vec!["one", "--content", content.as_str(), "--max-tokens", "300"];
            args.extend_from_slice(extra);
            client(&url, &args).await.0.remove(0)
        }
    };
    let mut want = 0;

    // Awkward chunks (1..7 bytes, splitting keys, numbers and escapes), plain and streamed.
    let r = one(
        json!({"mode": "awkward", "prompt_tokens": 11, "completion_tokens": 12}),
        &[],
    )
    .await;
    assert_eq!(r["status"], 200, "{r}");
    want += 23;
    charged_reaches(&c, &gw.admin, want, "awkward").await;
    let r = one(
        json!({"mode": "awkward", "prompt_tokens": 13, "completion_tokens": 14}),
        &["--stream"],
    )
    .await;
    assert_eq!(r["usage"]["total_tokens"], 27, "{r}");
    want += 27;
    charged_reaches(&c, &gw.admin, want, "awkward, streamed").await;

    // A 10 MB answer with its usage at the very end: read through, never buffered.
    let r = one(json!({"mode": "big", "prompt_tokens": 5, "completion_tokens": 7}), &[]).await;
    assert_eq!(r["status"], 200, "{r}");
    want += 12;
    charged_reaches(&c, &gw.admin, want, "10 MB").await;

    // No usage: the reservation (max_tokens, 300) stays, and is counted.
    let r = one(json!({"mode": "no_usage"}), &[]).await;
    assert_eq!(r["status"], 200, "{r}");
    want += 300;
    charged_reaches(&c, &gw.admin, want, "no usage").await;

    // Malformed JSON holding a smaller total partway: never less than the reservation.
    let r = one(
        json!({"mode": "malformed", "prompt_tokens": 5, "completion_tokens": 7}),
        &[],
    )
    .await;
    assert_eq!(r["status"], 200, "{r}");
    want += 300;
    charged_reaches(&c, &gw.admin, want, "malformed").await;
    // ... and one holding a larger total: the larger.
    let r = one(
        json!({"mode": "malformed", "prompt_tokens": 500, "completion_tokens": 7}),
        &[],
    )
    .await;
    assert_eq!(r["status"], 200, "{r}");
    want += 507;
    charged_reaches(&c, &gw.admin, want, "malformed, larger").await;

    // An upstream 500 (its body reports usage): `count_when` says 5xx does not spend.
    let r = one(
        json!({"mode": "status_500", "prompt_tokens": 5, "completion_tokens": 7}),
        &[],
    )
    .await;
    assert_eq!(r["status"], 500, "{r}");
    charged_reaches(&c, &gw.admin, want, "upstream 500").await;

    // The client leaves mid-stream: the stream is read on; the reservation is charged, or
    // what the stream reported if that is larger.
    let r = one(
        json!({"mode": "slow", "slow_chunks": 10, "slow_ms": 50, "prompt_tokens": 5, "completion_tokens": 40}),
        &["--stream", "--abort-after-chunks", "2"],
    )
    .await;
    assert_eq!(r["aborted"], true, "{r}");
    want += 300;
    charged_reaches(&c, &gw.admin, want, "left mid-stream").await;
    let r = one(
        json!({"mode": "slow", "slow_chunks": 10, "slow_ms": 50, "prompt_tokens": 400, "completion_tokens": 40}),
        &["--stream", "--abort-after-chunks", "2"],
    )
    .await;
    assert_eq!(r["aborted"], true, "{r}");
    want += 440;
    charged_reaches(&c, &gw.admin, want, "left mid-stream, larger report").await;

    // Nothing leaks: no reservation waits, and the unreadable answers were counted.
    let m = get_text(&c, format!("{}/metrics", gw.admin)).await;
    assert_eq!(
        metric(&m, "tollgate_cost_reservations_in_flight").as_deref(),
        Some("0"),
        "{m}"
    );
    let src = "rule=\"total\",source=\"json usage.total_tokens\"";
    assert_eq!(
        metric(
            &m,
            &format!("tollgate_cost_unreported_total{{{src},reason=\"absent\"}}")
        )
        .as_deref(),
        Some("1"),
        "{m}"
    );
    assert_eq!(
        metric(
            &m,
            &format!("tollgate_cost_unreported_total{{{src},reason=\"malformed\"}}")
        )
        .as_deref(),
        Some("2"),
        "{m}"
    );
    // Every answer the upstream gave was for one of these requests.
    assert_eq!(up.answered().len(), 9, "{:?}", up.answered());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_time_to_first_byte_is_the_same_with_and_without_the_rule() {
    let server = RedisServer::start();
    let up = Upstream::start();
    let plain = r#"rules:
  - { name: plain, match: { path: /v1/chat/completions }, key: ip, algorithm: fixed_window, limit: 1000000, window: 1h }
"#;
    let tokens = r#"rules:
  - { name: tokens, match: { path: /v1/chat/completions }, key: ip, algorithm: fixed_window, limit: 10000000, window: 1h, cost_from: { json: usage.total_tokens, max: 100000 }, estimate: { json: max_tokens, default: 4096 } }
"#;
    let st = store("redis", &[server.url()]);
    let (g1, g2) = (binary(&up.url, &st, plain), binary(&up.url, &st, tokens));
    // Alternate the two, three rounds, so drift in the machine's load hits both alike.
    let (mut with, mut without) = (Vec::new(), Vec::new());
    for _ in 0..3 {
        let (_, s) = client(&g1.url, &["ttfb", "--requests", "20"]).await;
        without.push(s["ttfb_median"].as_f64().unwrap());
        let (_, s) = client(&g2.url, &["ttfb", "--requests", "20"]).await;
        with.push(s["ttfb_median"].as_f64().unwrap());
    }
    with.sort_by(f64::total_cmp);
    without.sort_by(f64::total_cmp);
    let (w, wo) = (with[1], without[1]);
    println!(
        "median time to first chunk: {:.2} ms with the token rule, {:.2} ms without",
        w * 1e3,
        wo * 1e3
    );
    // The same within the machine's noise: the scan holds no byte back.
    assert!(w <= wo * 1.5 + 0.002, "with {w:.4} s, without {wo:.4} s");
    let c = reqwest::Client::new();
    let v = counter(&c, &g2.admin, "127.0.0.1", "1h", 10000000).await;
    assert!(u(&v["charged"]) > 0 && v["reserved"] == 0, "{v}");
}

/// A hostile client's spellings and switches (found by playing one; docs/ai.md "What a request
/// reserves"): each must reserve at least what the upstream will read, or be charged `max`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_spellings_never_reserve_less_than_the_upstream_reads() {
    // 5,000 output tokens a minute; a request reserves max_tokens × n, at most 4,096.
    let rules = r#"rules:
  - name: out
    match: { path: /v1/chat/completions }
    key: ip
    algorithm: fixed_window
    limit: 5000
    window: 1m
    failure: closed
    cost_from: { json: usage.completion_tokens, max: 4096, missing: max }
    estimate: { json: [max_tokens, max_completion_tokens], times: "n", default: 4096 }
"#;
    let server = RedisServer::start();
    let up = Upstream::start();
    let gw = binary(&up.url, &store("redis", &[server.url()]), rules);
    let c = reqwest::Client::new();
    let post = |body: String| {
        let (c, url) = (c.clone(), format!("{}/v1/chat/completions", gw.url));
        async move {
            c.post(url)
                .header("content-type", "application/json")
                .body(body)
                .send()
                .await
                .unwrap()
        }
    };
    let slow = r#"[{"role":"user","content":"{\"completion_tokens\": 5, \"delay_ms\": 1500}"}]"#;
    let fast = r#"[{"role":"user","content":"{\"completion_tokens\": 5}"}]"#;
    // Each first request is held at the upstream 1.5 s; a second of 2,000 fits only if the
    // first reserved less than 3,000.
    let spellings = [
        // A duplicate key whose later value is too long to read exactly (Python reads 4000).
        format!(
            r#"{{"model":"m","max_tokens":1,"max_tokens":4000.{},"messages":{slow}}}"#,
            "0".repeat(45)
        ),
        // The newer name, as a string.
        format!(r#"{{"model":"m","max_tokens":1,"max_completion_tokens":"4000","messages":{slow}}}"#),
        // n answers of 1,000 each.
        format!(r#"{{"model":"m","max_tokens":1000,"n":4,"messages":{slow}}}"#),
        // An escaped key name.
        format!(r#"{{"model":"m","max\u005ftokens":4000,"messages":{slow}}}"#),
    ];
    for (i, first) in spellings.into_iter().enumerate() {
        let held = tokio::spawn(post(first.clone()));
        let reserved = eventually(Duration::from_secs(5), || async {
            u(&counter(&c, &gw.admin, "127.0.0.1", "1m", 5000).await["remaining"]) <= 5000 - 3000
        })
        .await;
        assert!(reserved, "spelling {i} reserved too little: {first}");
        let second = post(format!(r#"{{"model":"m","max_tokens":2000,"messages":{fast}}}"#)).await;
        assert_eq!(second.status(), 429, "spelling {i}: {first}");
        assert_eq!(held.await.unwrap().status(), 200);
        // Settled to what was reported (5), the minute's count back near empty.
        let reset = reqwest::Client::new()
            .delete(format!("{}/keys/127.0.0.1", gw.admin))
            .send()
            .await
            .unwrap();
        assert!(reset.status().is_success());
    }
    // A stream asked without usage (no stream_options) cannot keep its prompt from being
    // counted: `missing: max` charges the most it could have been.
    let before = u(&counter(&c, &gw.admin, "127.0.0.1", "1m", 5000).await["remaining"]);
    let r = post(format!(
        r#"{{"model":"m","max_tokens":10,"stream":true,"messages":{fast}}}"#
    ))
    .await;
    assert_eq!(r.status(), 200);
    let _ = r.bytes().await.unwrap();
    let charged = eventually(Duration::from_secs(5), || async {
        u(&counter(&c, &gw.admin, "127.0.0.1", "1m", 5000).await["remaining"]) + 4096 <= before
    })
    .await;
    assert!(charged, "a stream without usage was not charged max");
}

/// A gateway told to stop while the answer of a client that left is still streaming charges it
/// before it exits: the usage reported (larger than the reservation), not the reservation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_waits_for_the_answer_of_a_client_that_left() {
    let rules = r#"rules:
  - name: total
    match: { path: /v1/chat/completions }
    key: ip
    algorithm: fixed_window
    limit: 10000000
    window: 1h
    failure: closed
    cost_from: { json: usage.total_tokens, max: 200000 }
    estimate: { json: max_tokens, default: 5000 }
"#;
    let server = RedisServer::start();
    let up = Upstream::start();
    let st = store("redis", &[server.url()]);
    let mut gw = binary(&up.url, &format!("{st}server:\n  drain: 0s\n"), rules);
    // Two seconds of stream; the client reads two events and leaves.
    let content =
        json!({"mode": "slow", "slow_chunks": 10, "slow_ms": 200, "prompt_tokens": 400, "completion_tokens": 40});
    let (r, _) = client(
        &gw.url,
        &[
            "one",
            "--content",
            &content.to_string(),
            "--max-tokens",
            "300",
            "--stream",
            "--abort-after-chunks",
            "2",
        ],
    )
    .await;
    assert_eq!(r[0]["aborted"], true, "{r:?}");
    let pid = gw.child.id().to_string();
    let killed = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(killed.success());
    let exited = eventually_blocking(Duration::from_secs(10), || matches!(gw.child.try_wait(), Ok(Some(_))));
    assert!(exited, "{}", gw.log());
    // Another gateway on the same store sees the charge: the 440 reported, not the 300.
    let next = binary(&up.url, &st, rules);
    let c = reqwest::Client::new();
    let v = counter(&c, &next.admin, "127.0.0.1", "1h", 10000000).await;
    assert_eq!(u(&v["charged"]), 440, "{v}\n{}", gw.log());
    let answered = up.answered();
    assert_eq!(
        answered.last().map(|a| a["total_tokens"].clone()),
        Some(json!(440)),
        "{answered:?}"
    );
}
