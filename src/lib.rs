//! tollgate: a rate-limiting HTTP reverse proxy.
//!
//! For every request tollgate identifies the caller, picks the most specific rule of each key
//! kind, checks and spends the caller's quota atomically in the store (memory, Redis or Redis
//! Cluster), then forwards the request upstream or answers 429 / 503 itself.
//!
//! # Layout
//!
//! | module | what it does |
//! |---|---|
//! | [`config`] | raw serde structs, validation into typed config, live reload of rules and keys |
//! | [`identity`] | request → [`identity::Identity`] (JWT, API key, client IP); pure, no I/O |
//! | [`rules`] | compiled rule set and matcher: (request, identity) → limits; pure, no I/O |
//! | [`limiter`] | algorithms, the [`limiter::Store`] trait, memory and Redis stores (Redis checks batched per slot by one task), deny cache, breaker, failure policy |
//! | [`proxy`] | the request path: identify → match → check → forward / respond |
//! | [`http`] | responses (the one place errors become HTTP), rate-limit headers, forwarding helpers, the upstream connection pool |
//! | [`gateway`] | shared state, listeners, graceful shutdown, background probe |
//! | [`admin`] | admin listener: health, readiness, metrics, rules, reload, explain, counters |
//! | [`metrics`] | Prometheus metrics with handles resolved at rule load |
//! | [`clock`] | injectable time ([`clock::FakeClock`] for tests) |
//! | [`demo`] | `tollgate demo`: an echo upstream plus the gateway on the memory store |
//! | [`log_throttle`] | rate-limited logging of errors that repeat during an outage |
//! | [`describe`] | plain-language descriptions of the loaded config for `check` and the admin API |
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

pub mod admin;
pub mod clock;
pub mod config;
pub mod demo;
pub mod describe;
pub mod http;
pub mod identity;
pub mod limiter;
pub mod log_throttle;
pub mod metrics;
pub mod proxy;
pub mod rules;
pub mod server;
pub mod state;
