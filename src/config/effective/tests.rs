//! `tollgate config`: each setting says where its value came from, and no secret is shown.

use super::*;

#[test]
fn each_setting_says_where_it_came_from_and_no_secret_is_shown() {
    let p = Path::new("/etc/tollgate/gateway.yaml");
    let text = "listen: 127.0.0.1:8080\nupstream: { url: \"http://127.0.0.1:8081\" }\nstore:\n  kind: redis\n  urls: [\"redis://:hunter2@10.0.0.1:6379\"]\n  timeout: 30ms\nserver:\n  drain: 3s\n";
    let raw: RawGateway = super::super::parse_str(p, text).unwrap_or_else(|e| panic!("{e}"));
    let env = EnvOverrides {
        listen: Some("0.0.0.0:9999".into()),
        ..Default::default()
    };
    let cfg = GatewayConfig::compile(
        p,
        super::super::parse_str(p, text).unwrap_or_else(|e| panic!("{e}")),
        &env,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let s = settings(p, &raw, &cfg, &env);
    let get = |n: &str| {
        s.iter()
            .find(|x| x.name == n)
            .cloned()
            .unwrap_or_else(|| panic!("no {n}"))
    };
    assert_eq!(
        (get("listen").value, get("listen").source),
        ("0.0.0.0:9999".into(), "env TOLLGATE_LISTEN".into())
    );
    assert_eq!(get("store.timeout").value, "30ms");
    assert_eq!(get("store.timeout").source, "/etc/tollgate/gateway.yaml:6:12");
    assert_eq!(get("server.drain").source, "/etc/tollgate/gateway.yaml:8:10");
    assert_eq!(get("server.idle_timeout").source, "default");
    let urls = get("store.urls");
    assert!(
        urls.value.contains("***") && !urls.value.contains("hunter2"),
        "{urls:?}"
    );
    assert!(s.iter().all(|x| !x.value.contains("hunter2")));
}
