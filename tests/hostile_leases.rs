//! Hostile client, leases (a hot key's quota decided locally from slices Redis has already spent
//! for one gateway): a client that hammers one key through every gateway of a fleet at once, so
//! that each holds a live lease, and then rides an operator's reset, a reload, or a window
//! boundary, hoping unused or expired lease units are spent twice. Three real binaries on the
//! real 6-node cluster, `failure: closed` (a check past the store deadline is a 503, never an
//! unchecked admission); what is admitted is counted at the client (ARCHITECTURE.md, "Leases
//! never let the fleet exceed a limit").
//!
//! | way around the limit | defence | test |
//! |---|---|---|
//! | one hot key through three gateways, 24 clients at once | a lease is spent in Redis when taken; the fleet admits at most the limit | `leases.rs`: `cluster_fleet_never_over_admits_a_hot_key_under_leases` |
//! | `DELETE /keys/{ip}` mid-flight while every gateway holds a lease | the reset marker: no grant, no return of old units into the new count; the counter goes once every lease expired | `a_reset_mid_flight_with_leases_held_starts_the_fleet_afresh` (three limiters, one Redis: `leases.rs`: `a_reset_while_leases_are_held_starts_the_count_afresh`) |
//! | reloads mid-flight (each returns the gateway's unused units) | only unused units go back, into the window they came from | `reloads_mid_flight_never_mint_quota` (one gateway, counted in Redis: `leases.rs`: `unused_lease_units_go_back_on_reload_and_on_shutdown`) |
//! | straddle a fixed window: spend a lease of one window in the next | a lease ends no later than the window it was counted in | `a_lease_never_outlives_its_window` |
//! | a token bucket's lease used late, after refill | spent as of its expiry (`tat`), granted only when it fits | `leases.rs`: `slow_refill_token_bucket_leases_lose_no_tokens`, and the token bucket of `reloads_mid_flight_never_mint_quota` |
//! | a penalty-box rule leased, so one gateway keeps admitting after another's breach | rules with a penalty never lease | `hostile_penalties.rs`: `a_penalty_reaches_every_gateway_at_once_with_leases_on` |

mod support;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use support::*;

/// Leases for any key seen 20 times a second, living 250 ms, at most 10 % of a limit.
fn store_yaml(cluster: &RedisCluster) -> String {
    let list: Vec<String> = cluster.seed_urls().iter().map(|u| format!("\"{u}\"")).collect();
    format!(
        "store:\n  kind: redis_cluster\n  urls: [{}]\n  timeout: 300ms\n  probe_interval: 100ms\n  leases: {{ min_rate: 20/s, ttl: 250ms, max_share: 0.1 }}\nidentity:\n  trusted_proxies: [127.0.0.1/32]\n",
        list.join(", ")
    )
}

fn rules(limit: &str) -> String {
    format!("rules:\n  - {{ name: hot, match: {{ path: \"/**\" }}, key: ip, failure: closed, {limit} }}\n")
}

fn fleet(up: &str, cluster: &RedisCluster, limit: &str) -> Vec<BinaryGateway> {
    let store = store_yaml(cluster);
    (0..3).map(|_| binary(up, &store, &rules(limit))).collect()
}

fn unix_us() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64
}

/// One request as the client saw it: sent and answered (unix µs), and its status.
#[derive(Clone, Copy, Debug)]
struct Seen {
    sent: u64,
    answered: u64,
    status: u16,
}

/// 24 clients sending from `ip` round-robin over the fleet until `stop` (or `max` requests):
/// the handle yields every request seen. `admitted` counts the 200s as they come.
struct Hammer {
    stop: Arc<AtomicBool>,
    admitted: Arc<AtomicUsize>,
    sent: Arc<AtomicUsize>,
    tasks: Vec<tokio::task::JoinHandle<Vec<Seen>>>,
}

impl Hammer {
    fn start(gws: &[BinaryGateway], ip: &str, max: usize) -> Hammer {
        let c = client();
        let urls: Arc<Vec<String>> = Arc::new(gws.iter().map(|g| format!("{}/hot", g.url)).collect());
        let (stop, admitted, sent) = (
            Arc::new(AtomicBool::new(false)),
            Arc::<AtomicUsize>::default(),
            Arc::<AtomicUsize>::default(),
        );
        let tasks = (0..24)
            .map(|_| {
                let (c, urls, ip) = (c.clone(), urls.clone(), ip.to_owned());
                let (stop, admitted, sent) = (stop.clone(), admitted.clone(), sent.clone());
                tokio::spawn(async move {
                    let mut seen = Vec::new();
                    while !stop.load(Ordering::Relaxed) {
                        let n = sent.fetch_add(1, Ordering::Relaxed);
                        if n >= max {
                            break;
                        }
                        let t = unix_us();
                        let r = c
                            .get(&urls[n % urls.len()])
                            .header("x-forwarded-for", &ip)
                            .send()
                            .await
                            .unwrap();
                        let status = r.status().as_u16();
                        let _ = r.bytes().await;
                        assert!([200, 429, 503].contains(&status), "unexpected status {status}");
                        if status == 200 {
                            admitted.fetch_add(1, Ordering::Relaxed);
                        }
                        seen.push(Seen {
                            sent: t,
                            answered: unix_us(),
                            status,
                        });
                    }
                    seen
                })
            })
            .collect();
        Hammer {
            stop,
            admitted,
            sent,
            tasks,
        }
    }

    fn admitted(&self) -> usize {
        self.admitted.load(Ordering::Relaxed)
    }

    async fn finish(self) -> Vec<Seen> {
        self.stop.store(true, Ordering::Relaxed);
        let mut all = Vec::new();
        for t in self.tasks {
            all.extend(t.await.unwrap());
        }
        all
    }
}

async fn fleet_metric(gws: &[BinaryGateway], name: &str) -> f64 {
    let c = client();
    let mut sum = 0.0;
    for g in gws {
        sum += metric_value(&c, &g.admin, name).await;
    }
    sum
}

/// A day's window of 1,200, hammered through three gateways; `DELETE /keys` on one of them once
/// 400 are admitted, the hammer going on. Of the requests sent after the reset answered, at most
/// the limit pass; of those sent after it was asked, at least the limit minus three leases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reset_mid_flight_with_leases_held_starts_the_fleet_afresh() {
    let cluster = RedisCluster::start();
    let up = echo().await;
    let gws = fleet(
        &format!("http://{up}"),
        &cluster,
        "algorithm: fixed_window, limit: 1200, window: 24h",
    );
    let ip = "10.34.0.1";
    let h = Hammer::start(&gws, ip, 20_000);
    assert!(
        eventually(Duration::from_secs(20), || async { h.admitted() >= 400 }).await,
        "the hammer never got going"
    );
    let c = client();
    let asked = unix_us();
    let r = c.delete(format!("{}/keys/{ip}", gws[0].admin)).send().await.unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    let reset = unix_us();
    // Go on until the fresh count is long spent: 2,400 more requests.
    let sent_at_reset = h.sent.load(Ordering::Relaxed);
    assert!(
        eventually(Duration::from_secs(30), || async {
            h.sent.load(Ordering::Relaxed) >= sent_at_reset + 2400
        })
        .await
    );
    let seen = h.finish().await;
    let admitted_since = |t: u64| seen.iter().filter(|s| s.status == 200 && s.sent >= t).count();
    let (after, since_asked) = (admitted_since(reset), admitted_since(asked));
    let local = fleet_metric(&gws, "tollgate_lease_decisions_total").await;
    println!("reset: {after} admitted after it, {since_asked} since it was asked, {local} decided from leases");
    assert!(
        local > 100.0,
        "leases decided only {local} requests: nothing was held at the reset"
    );
    assert!(after <= 1200, "{after} admitted after the reset, over the limit 1,200");
    assert!(
        since_asked >= 1200 - 3 * 120,
        "only {since_asked} admitted since the reset was asked"
    );
}

/// Fifteen reloads, round the fleet every 50 ms, while 24 clients hammer one key: each reload
/// returns a gateway's unused lease units, and the fleet still admits at most the limit (a
/// token bucket: its capacity plus what refilled meanwhile).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reloads_mid_flight_never_mint_quota() {
    let cluster = RedisCluster::start();
    let up = echo().await;
    for (ip, limit, of) in [
        ("10.34.1.1", "algorithm: fixed_window, limit: 6000, window: 24h", 6000),
        ("10.34.1.2", "algorithm: token_bucket, capacity: 6000, rate: 1/s", 6000),
    ] {
        let gws = fleet(&format!("http://{up}"), &cluster, limit);
        let started = std::time::Instant::now();
        let h = Hammer::start(&gws, ip, 1_000_000);
        let c = client();
        let mut every = tokio::time::interval(Duration::from_millis(50)); // pacing the reloads
        let mut live_reloads = 0;
        for i in 0..15 {
            every.tick().await;
            let r = c.post(format!("{}/reload", gws[i % 3].admin)).send().await.unwrap();
            assert_eq!(r.status(), 200);
            live_reloads += usize::from(h.admitted() < of - of / 10);
        }
        // On until the quota is long spent.
        assert!(
            eventually(Duration::from_secs(20), || async {
                h.sent.load(Ordering::Relaxed) >= 2 * of
            })
            .await
        );
        let seen = h.finish().await;
        let admitted = seen.iter().filter(|s| s.status == 200).count();
        let refilled = if limit.contains("token_bucket") {
            started.elapsed().as_secs() as usize + 1
        } else {
            0
        };
        let returned = fleet_metric(&gws, "tollgate_leases_returned_total").await;
        println!(
            "{limit}: {admitted} admitted of {} requests, {live_reloads} of 15 reloads while quota was left, {returned} leases returned",
            seen.len()
        );
        assert!(
            live_reloads >= 5,
            "{limit}: only {live_reloads} reloads came while quota was left"
        );
        assert!(returned >= 1.0, "{limit}: no lease was returned");
        assert!(
            admitted <= of + refilled,
            "{limit}: {admitted} admitted through reloads, over {of} + {refilled}"
        );
        assert!(admitted >= of - 3 * of / 10, "{limit}: only {admitted} admitted");
    }
}

/// 200 per 2 s window, hammered through three gateways for 5 s: a request sent and answered
/// within one window was admitted in it, and no window admits more than 200 of those. A lease
/// that outlived its window would be spent on top of the next window's own 200.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_never_outlives_its_window() {
    const W: u64 = 2_000_000;
    let cluster = RedisCluster::start();
    let up = echo().await;
    let gws = fleet(
        &format!("http://{up}"),
        &cluster,
        "algorithm: fixed_window, limit: 200, window: 2s",
    );
    let h = Hammer::start(&gws, "10.34.2.1", 1_000_000);
    let until = unix_us() + 5_000_000;
    assert!(eventually(Duration::from_secs(8), || async { unix_us() >= until }).await);
    let seen = h.finish().await;
    let mut per_window = std::collections::BTreeMap::<u64, usize>::new();
    for s in seen.iter().filter(|s| s.status == 200 && s.sent / W == s.answered / W) {
        *per_window.entry(s.sent / W).or_default() += 1;
    }
    let local = fleet_metric(&gws, "tollgate_lease_decisions_total").await;
    println!(
        "per window: {per_window:?} of {} requests, {local} decided from leases",
        seen.len()
    );
    assert!(local > 50.0, "leases decided only {local} requests");
    for (w, n) in &per_window {
        assert!(
            *n <= 200,
            "window {w} admitted {n} (limit 200): a lease outlived its window"
        );
    }
    // The run spent whole windows (the test saw the boundary under load).
    let full = per_window.values().filter(|&&n| n >= 200 - 3 * 20).count();
    assert!(full >= 2, "fewer than two windows were spent: {per_window:?}");
}
