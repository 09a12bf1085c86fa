//! The engine on its own: facts in, a decision out, on the memory store with a fake clock; no
//! listener, no upstream, no HTTP request.

use std::net::IpAddr;
use std::sync::Arc;

use http::{HeaderMap, HeaderValue, Method, Uri};

use super::{Decision, Engine, Facts};
use crate::clock::FakeClock;
use crate::config::{EnvOverrides, GatewayConfig};
use crate::identity::CredentialProblem;
use crate::state::State;

const NOW_US: u64 = 1_800_000_000_000_000;

async fn gateway(rules: &str) -> (tempfile::TempDir, Arc<State>) {
    let dir = tempfile::tempdir().unwrap();
    let gw = dir.path().join("gateway.yaml");
    std::fs::write(
        &gw,
        "upstream: { url: http://127.0.0.1:1 }\nrules_file: rules.yaml\nidentity:\n  invalid_credentials: reject\n",
    )
    .unwrap();
    std::fs::write(dir.path().join("rules.yaml"), rules).unwrap();
    let config = GatewayConfig::load(&gw, &EnvOverrides::default()).unwrap_or_else(|e| panic!("{e}"));
    let state = State::with_clock(config, Arc::new(FakeClock::new(NOW_US)))
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    (dir, state)
}

async fn decide(gw: &State, path: &str, headers: &HeaderMap) -> Decision {
    let snap = gw.snapshot().load_full();
    let engine = Engine {
        snap: &snap,
        keys: gw.keys(),
        identity: &gw.config().identity,
        limiter: gw.limiter(),
        regions: None,
    };
    let uri: Uri = path.parse().unwrap();
    let facts = Facts {
        method: &Method::GET,
        uri: &uri,
        headers,
        peer: IpAddr::from([192, 0, 2, 7]),
    };
    let (_, _, decision) = engine.decide(&gw.runtime().load(), facts, NOW_US).await;
    decision
}

#[tokio::test]
async fn facts_in_a_decision_out_and_the_limit_binds() {
    let (_dir, gw) =
        gateway("rules:\n  - { name: login, match: { path: /login }, key: ip, limit: 2, window: 1m }\n").await;
    let none = HeaderMap::new();
    assert_eq!(decide(&gw, "/login", &none).await, Decision::Admit { binding: Some(0) });
    assert_eq!(decide(&gw, "/login", &none).await, Decision::Admit { binding: Some(0) });
    assert_eq!(decide(&gw, "/login", &none).await, Decision::Limited { binding: 0 });
    assert_eq!(
        decide(&gw, "/other", &none).await,
        Decision::Unmatched,
        "no rule: unchecked"
    );
    // The path the engine decides on is the normalised one.
    assert_eq!(
        decide(&gw, "/x/../login", &none).await,
        Decision::Limited { binding: 0 }
    );
}

#[tokio::test]
async fn a_refused_credential_spends_nothing() {
    let (_dir, gw) =
        gateway("rules:\n  - { name: all, match: { path: \"/**\" }, key: ip, limit: 1, window: 1m }\n").await;
    let mut bad = HeaderMap::new();
    bad.insert("x-api-key", HeaderValue::from_static("no-such-key"));
    assert_eq!(
        decide(&gw, "/a", &bad).await,
        Decision::Refused(CredentialProblem::Invalid)
    );
    assert_eq!(
        decide(&gw, "/a", &HeaderMap::new()).await,
        Decision::Admit { binding: Some(0) },
        "the refused request spent none of the caller's one unit"
    );
}
