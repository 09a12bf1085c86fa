//! The ONE test support module of the integration tests. Every test binary
//! includes it with `mod support;` and uses a subset of it, hence the `dead_code` allowance.
//!
//! * [`redis`](self::redis): real `redis-server` processes, standalone and a 6-node cluster, on
//!   free loopback ports, killed on drop;
//! * [`gateway`](self::gateway): the gateway library on port 0 ([`TestGateway`], stopped on
//!   drop), the real `tollgate` binary ([`BinaryGateway`], killed on drop), the echo upstream,
//!   config directories;
//! * [`http`](self::http): an HTTP client and small request/metrics helpers;
//! * [`upstream`](self::upstream): a real upstream that counts the requests it serves at once;
//! * [`faults`](self::faults): a TCP proxy that adds latency, black-holes or resets traffic to
//!   one Redis node;
//! * [`grpc`](self::grpc): a real gRPC server and client (Python grpcio, as subprocesses) and
//!   the real binary in front of the server;
//! * [`rls`](self::rls): the real `tollgate rls` binary on an envoyproxy/ratelimit config
//!   directory, and an independent client (Python grpcio, Envoy's own protos);
//! * [`tls`](self::tls): a test CA made with rcgen, an HTTPS echo upstream, Redis over TLS
//!   with a password (standalone and cluster);
//! * [`otlp`](self::otlp): a real OTLP/HTTP traces receiver (Python, `opentelemetry-proto`)
//!   writing the spans it gets as JSON lines;
//! * [`poll`](self::poll): [`eventually`] and friends, the only way tests wait for something.
//!
//! Nothing here mocks anything: if `redis-server` or `redis-cli` is missing the tests fail,
//! they never skip.
#![allow(dead_code, unused_imports)]

mod faults;
mod gateway;
mod grpc;
mod http;
mod otlp;
mod poll;
mod redis;
mod rls;
mod tls;
mod upstream;

pub use self::faults::{FaultProxy, Faults};
pub use self::gateway::*;
pub use self::grpc::{grpc_client, grpc_gateway, GrpcServer};
pub use self::http::*;
pub use self::otlp::OtlpReceiver;
pub use self::poll::*;
pub use self::redis::{command_calls, has_library, redis_cli, RedisCluster, RedisServer};
pub use self::rls::{descriptors_json, rls_node, start_of_second, tollgate_check, within_second, RlsClient, RlsNode};
pub use self::tls::*;
pub use self::upstream::{counting_upstream, CountingUpstream, Instance};

use std::net::{SocketAddr, TcpListener};

/// `127.0.0.1:port`.
pub fn loopback(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// A free loopback port (the OS picks it; released before returning, so there is a small race
/// with other processes, which the callers that spawn servers absorb by retrying).
pub fn free_port() -> u16 {
    let l = TcpListener::bind(loopback(0)).expect("bind 127.0.0.1:0");
    l.local_addr().expect("local_addr").port()
}

/// The bytes of `tests/fixtures/jwt/<name>`.
pub fn jwt_fixture(name: &str) -> Vec<u8> {
    std::fs::read(format!("{}/tests/fixtures/jwt/{name}", env!("CARGO_MANIFEST_DIR"))).unwrap()
}
