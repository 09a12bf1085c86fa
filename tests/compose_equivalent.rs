//! The docker-compose topology with plain processes: the real `tollgate` binary runs the shipped
//! `config/gateway.cluster.yaml`, `rules.yaml` and `keys.yaml` (only host names and ports
//! rewritten) against a real 6-node Redis Cluster and a real upstream.

mod support;

use std::process::Command;
use std::time::Duration;

use support::*;

#[test]
fn the_shipped_cluster_config_enforces_its_rules() {
    let cluster = RedisCluster::start();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let up = rt.block_on(echo());
    let up2 = rt.block_on(echo());
    let dir = tempfile::tempdir().unwrap();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
    let (port, admin) = (free_port(), free_port());
    let mut gw = std::fs::read_to_string(root.join("gateway.cluster.yaml")).unwrap();
    for (i, seed) in cluster.seed_urls().iter().enumerate() {
        gw = gw.replace(&format!("redis://redis-{}:6379", i + 1), seed);
    }
    gw = gw
        .replace("http://upstream:8080", &format!("http://{up}"))
        .replace("http://upstream-2:8080", &format!("http://{up2}"))
        .replace("listen: 0.0.0.0:8080", &format!("listen: 127.0.0.1:{port}"))
        .replace(
            "admin_listen: 0.0.0.0:9090",
            &format!("admin_listen: 127.0.0.1:{admin}"),
        );
    assert!(!gw.contains("redis-1:6379"), "every compose host name rewritten");
    assert!(!gw.contains("upstream-2:8080"), "both upstream instances rewritten");
    std::fs::write(dir.path().join("gateway.yaml"), gw).unwrap();
    for f in ["rules.yaml", "keys.yaml"] {
        std::fs::copy(root.join(f), dir.path().join(f)).unwrap();
    }
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tollgate"));
    cmd.args(["run", "--config"])
        .arg(dir.path().join("gateway.yaml"))
        .env_remove("TOLLGATE_LISTEN")
        .env_remove("TOLLGATE_REDIS_URLS")
        .env_remove("TOLLGATE_REDIS_URL")
        // The shipped config reads its admin token from here (docker-compose.yml sets it).
        .env("TOLLGATE_ADMIN_TOKEN", "compose-equivalent-test-token");
    let gw = BinaryGateway::spawn(&mut cmd, dir.path().join("tollgate.log"), &[port, admin]);
    let base = gw.url.clone();
    let result = rt.block_on(async {
        let c = client();
        let ready = eventually(Duration::from_secs(10), || async {
            c.get(format!("{}/readyz?store=1", gw.admin))
                .send()
                .await
                .is_ok_and(|r| r.status() == 200)
        })
        .await;
        assert!(ready, "not ready: {}", gw.log());
        // Anonymous: `anonymous-per-ip`, 60 a minute.
        let mut ok = 0;
        for _ in 0..70 {
            if c.get(format!("{base}/api/v1/search")).send().await.unwrap().status() == 200 {
                ok += 1;
            }
        }
        // A free-tier key: `search-free`, 5 a second (burst).
        let mut free_ok = 0;
        for _ in 0..8 {
            let r = c
                .get(format!("{base}/api/v1/search"))
                .header("x-api-key", "globex-free-0c1d2e3f")
                .send()
                .await
                .unwrap();
            if r.status() == 200 {
                free_ok += 1;
            }
        }
        (ok, free_ok)
    });
    drop(gw);
    assert_eq!(result, (60, 5), "anonymous per-IP 60/min, free search 5/s");
}
