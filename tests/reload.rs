//! Hot reload end to end: atomic renames, Kubernetes `..data` symlink swaps, broken files,
//! counters surviving reloads, and 30 rewrites under concurrent load.

mod support;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use support::*;

fn rules(name: &str, limit: u64) -> String {
    format!("rules:\n  - {{ name: {name}, match: {{ path: \"/**\" }}, key: global, algorithm: fixed_window, limit: {limit}, window: 1h }}\n")
}

async fn version(c: &reqwest::Client, admin: &str) -> String {
    let v: serde_json::Value = get_json(c, format!("{admin}/rules")).await;
    v["version"].as_str().unwrap().to_string()
}

/// Wait until the rule-set version differs from `old`; returns how long that took.
async fn wait_for_change(c: &reqwest::Client, admin: &str, old: &str) -> Duration {
    let t0 = Instant::now();
    let changed = eventually(Duration::from_secs(3), || async { version(c, admin).await != old }).await;
    assert!(changed, "reload not seen");
    t0.elapsed()
}

/// Refused reloads so far (`tollgate_reloads_total{result="error"}`).
async fn reload_errors(c: &reqwest::Client, admin: &str) -> f64 {
    metric_value(c, admin, "tollgate_reloads_total{result=\"error\"}").await
}

/// Wait until the watcher has refused a reload beyond the `before` refused so far.
async fn wait_for_refusal(c: &reqwest::Client, admin: &str, before: f64) {
    let refused = eventually(Duration::from_secs(3), || async {
        reload_errors(c, admin).await > before
    })
    .await;
    assert!(refused, "the watcher did not try (and refuse) the change");
}

#[tokio::test]
async fn an_atomic_rename_is_live_within_a_second_and_counters_survive() {
    let up = echo().await;
    let gw = gateway(&format!("http://{up}"), "", &rules("r", 5), None).await;
    let c = client();
    for _ in 0..3 {
        assert_eq!(c.get(format!("{}/x", gw.url)).send().await.unwrap().status(), 200);
    }
    let v0 = version(&c, &gw.admin).await;
    // Same rule, same window, a comment added: the counter carries on.
    gw.write_rules(&format!("# edited\n{}", rules("r", 5)));
    let took = wait_for_change(&c, &gw.admin, &v0).await;
    assert!(took < Duration::from_secs(1), "live in {took:?}");
    let codes: Vec<u16> = futures_util::future::join_all((0..3).map(|_| c.get(format!("{}/x", gw.url)).send()))
        .await
        .into_iter()
        .map(|r| r.unwrap().status().as_u16())
        .collect();
    assert_eq!(
        codes.iter().filter(|s| **s == 200).count(),
        2,
        "{codes:?}: 3 + 2 = the limit of 5"
    );
    gw.stop().await;
}

#[tokio::test]
async fn a_broken_file_is_refused_and_the_old_rules_stay() {
    let up = echo().await;
    let gw = gateway(&format!("http://{up}"), "", &rules("r", 2), None).await;
    let c = client();
    let v0 = version(&c, &gw.admin).await;
    assert_eq!(reload_errors(&c, &gw.admin).await, 0.0);
    gw.write_rules("rules:\n  - { name: r, match: { path: \"/**\" }, key: global, limit: 0, window: 1h }\n");
    // The watcher saw the file and refused it (instead of sleeping and hoping it looked).
    wait_for_refusal(&c, &gw.admin, 0.0).await;
    assert_eq!(version(&c, &gw.admin).await, v0, "bad rules must not load");
    let r = c.post(format!("{}/reload", gw.admin)).send().await.unwrap();
    assert_eq!(r.status(), 422);
    let body: serde_json::Value = r.json().await.unwrap();
    assert!(body["error"].as_str().unwrap().contains("rules.yaml:2:"), "{body}");
    let m = get_text(&c, format!("{}/metrics", gw.admin)).await;
    assert!(m.contains("tollgate_reloads_total{result=\"error\"}"), "{m}");
    assert!(!m.contains("tollgate_reloads_total{result=\"error\"} 0"));
    // The old limit of 2 still applies.
    let mut codes = Vec::new();
    for _ in 0..3 {
        codes.push(c.get(format!("{}/x", gw.url)).send().await.unwrap().status().as_u16());
    }
    assert_eq!(codes, vec![200, 200, 429]);
    // A missing file is refused too.
    let before = reload_errors(&c, &gw.admin).await;
    std::fs::remove_file(gw.path("rules.yaml")).unwrap();
    wait_for_refusal(&c, &gw.admin, before).await;
    assert_eq!(version(&c, &gw.admin).await, v0);
    gw.stop().await;
}

#[cfg(unix)]
#[tokio::test]
async fn a_kubernetes_configmap_symlink_swap_is_seen() {
    use std::os::unix::fs::symlink;
    let up = echo().await;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let v1 = d.join("..2026_01");
    std::fs::create_dir(&v1).unwrap();
    std::fs::write(v1.join("rules.yaml"), rules("old", 1)).unwrap();
    symlink("..2026_01", d.join("..data")).unwrap();
    symlink("..data/rules.yaml", d.join("rules.yaml")).unwrap();
    let cfg_path = d.join("gateway.yaml");
    std::fs::write(&cfg_path, format!("listen: 127.0.0.1:0\nadmin_listen: 127.0.0.1:0\nupstream: {{ url: http://{up} }}\nrules_file: rules.yaml\n")).unwrap();
    let gw = gateway_from(&cfg_path, dir).await;
    let admin = gw.admin.clone();
    let d = gw.dir.path();
    let c = client();
    let v0 = version(&c, &admin).await;
    // kubelet: write a new timestamped dir, then atomically swap ..data.
    let v2 = d.join("..2026_02");
    std::fs::create_dir(&v2).unwrap();
    std::fs::write(v2.join("rules.yaml"), rules("new", 7)).unwrap();
    symlink("..2026_02", d.join("..data_tmp")).unwrap();
    std::fs::rename(d.join("..data_tmp"), d.join("..data")).unwrap();
    std::fs::remove_dir_all(&v1).unwrap();
    let took = wait_for_change(&c, &admin, &v0).await;
    assert!(took < Duration::from_secs(1), "{took:?}");
    let v: serde_json::Value = get_json(&c, format!("{admin}/rules")).await;
    assert_eq!(v["rules"][0]["name"], "new");
    gw.stop().await;
}

#[tokio::test]
async fn thirty_rewrites_under_concurrent_load_lose_no_request_and_the_final_limit_holds() {
    let up = echo().await;
    let gw = gateway(&format!("http://{up}"), "", &rules("gen0", 1_000_000), None).await;
    let stop = Arc::new(AtomicBool::new(false));
    let failures = Arc::new(AtomicU64::new(0));
    let served = Arc::new(AtomicU64::new(0));
    let mut load = Vec::new();
    for _ in 0..8 {
        let (stop, failures, served, url) = (stop.clone(), failures.clone(), served.clone(), format!("{}/x", gw.url));
        load.push(tokio::spawn(async move {
            let c = client();
            while !stop.load(Ordering::Relaxed) {
                match c.get(&url).send().await {
                    Ok(r) if r.status() == 200 || r.status() == 429 => {
                        served.fetch_add(1, Ordering::Relaxed);
                    }
                    _ => {
                        failures.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }));
    }
    for i in 1..=30 {
        // Alternate atomic renames and in-place truncating writes (what many tools do).
        let text = rules(&format!("gen{i}"), 1_000_000 + i);
        if i % 2 == 0 {
            gw.write_rules(&text);
        } else {
            std::fs::write(gw.path("rules.yaml"), text).unwrap();
        }
        // Not synchronisation: pacing, so the watcher sees many separate rewrites under load.
        tokio::time::sleep(Duration::from_millis(60)).await;
    }
    gw.write_rules(&rules("final", 25));
    let c = client();
    let loaded = eventually(Duration::from_secs(2), || async {
        get_json(&c, format!("{}/rules", gw.admin)).await["rules"][0]["name"] == "final"
    })
    .await;
    assert!(loaded, "final rules not loaded");
    // Keep the load going under the final rules until it has used up their limit (it denies),
    // then stop and count.
    let denied = eventually(Duration::from_secs(5), || async {
        metric_value(
            &c,
            &gw.admin,
            "tollgate_requests_total{rule=\"final\",decision=\"denied\"}",
        )
        .await
            > 0.0
    })
    .await;
    assert!(denied, "the load never reached the final limit");
    stop.store(true, Ordering::Relaxed);
    for l in load {
        l.await.unwrap();
    }
    assert_eq!(failures.load(Ordering::Relaxed), 0, "requests failed during reloads");
    assert!(served.load(Ordering::Relaxed) > 100);
    // The final limit holds: at most 25 admitted under it in its window, whatever the load.
    let mut admitted_after = 0;
    for _ in 0..30 {
        if c.get(format!("{}/x", gw.url)).send().await.unwrap().status() == 200 {
            admitted_after += 1;
        }
    }
    assert_eq!(
        admitted_after, 0,
        "the final limit of 25 was already used up by the load"
    );
    let m = get_text(&c, format!("{}/metrics", gw.admin)).await;
    let line = m
        .lines()
        .find(|l| l.starts_with("tollgate_requests_total{rule=\"final\",decision=\"allowed\"}"))
        .unwrap();
    assert!(line.ends_with(" 25"), "{line}");
    gw.stop().await;
}

/// SIGHUP reloads even when no file changed (the operator asked for it).
#[cfg(unix)]
#[test]
fn sighup_reloads_the_real_binary() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let up = rt.block_on(echo());
    let gw = binary(&format!("http://{up}"), "", &rules("r", 5));
    let reloads_ok = || {
        let m = rt.block_on(get_text(&client(), format!("{}/metrics", gw.admin)));
        metric(&m, "tollgate_reloads_total{result=\"ok\"}").unwrap_or_default()
    };
    assert_eq!(reloads_ok(), "0");
    let pid = gw.child.id().to_string();
    assert!(std::process::Command::new("kill")
        .args(["-HUP", &pid])
        .status()
        .unwrap()
        .success());
    let reloaded = eventually_blocking(Duration::from_secs(2), || reloads_ok() == "1");
    assert!(reloaded, "SIGHUP did not reload");
}
