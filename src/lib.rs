//! tollgate: a rate-limiting HTTP reverse proxy.
//!
//! For every request tollgate identifies the caller, picks the most specific rule of each key
//! kind, checks and spends the caller's quota atomically in the store (memory, Redis or Redis
//! Cluster), then forwards the request upstream or answers 429 / 503 itself.
//!
//! # Layout
//!
//! Data flows one way: [`server`] wires everything → [`proxy`] (or [`rls`]) handles one request → the core
//! below it ([`rules`], [`identity`], [`limiter`], pure or behind the [`limiter::Store`] trait) →
//! [`http`] (bytes out). Nothing below [`server`] holds an `Arc` of more than [`state::State`].
//! The file-level import graph has no cycle (`scripts/check-cycles`, run by `scripts/test`).
//!
//! | module | what it does |
//! |---|---|
//! | [`server`] | composition root: binds listeners, starts admin, file watcher and store probe, owns shutdown; `server/conn` accepts and serves connections (h2c sniff, TLS, idle parking, drain) |
//! | [`state`] | the shared state (config, snapshot handle, limiter, metrics; private fields); `state::reload` swaps the snapshot |
//! | [`engine`] | the decision with no HTTP server around it: request facts → identity and plan (`engine::plan`, one `RequestPlan` per request) → the limiter's verdict → a `Decision`; no metrics, logs or responses |
//! | [`proxy`] | the request path around the engine: named phases over one per-request context (`proxy::ctx`): validate → plan → estimate → check (the engine) → admit → forward → settle → log, one file each |
//! | [`rls`] | the Envoy rate-limit service front end: `ShouldRateLimit` over gRPC (and `/json`), envoyproxy/ratelimit's config files (`rls::config`), descriptor matching (`rls::matcher`), one all-or-nothing limiter check per request (`rls::decide`), the listener (`rls::serve`) |
//! | [`background`] | low-priority threads for reloads and for freeing replaced snapshots, so neither competes with requests |
//! | [`adaptive`] | adaptive concurrency: a per-node limit on requests in flight to the upstream, learned from latency (`adaptive/control`, pure), with priority classes refused lowest first; owns its config types (`adaptive::raw` as written, `adaptive::config` validated, with the rules' priorities checked against it) |
//! | [`regions`] | several regions: `scope: global` rules count the spend of peer regions' stores, read by a background sync task (`regions::sync`, over `regions::link`; budget reports in `regions::report`) into memory the engine reads; `sync` and `budget` modes; owns its config types (`regions::config`) |
//! | [`activity`] | what the admin dashboard shows over time: per-second rule rates, most limited hashes, store and reload history |
//! | [`admin`] | admin listener: health, readiness, status, metrics, rules, reload, explain, counters (`identities`), JSON views of rules and limits (`views`); token auth |
//! | [`config`] | composes the subsystems' own config types (`rules::raw`, `identity::raw`, `http::tls`, `http::upstream::settings`, `limiter::redis`) into `GatewayConfig`; the gateway-level raw structs, validation, the file watcher. Nothing below it imports it |
//! | [`yaml`] | below every subsystem: errors that name `file:line:col`, sized YAML parsing, durations, [`yaml::Secret`] |
//! | [`identity`] | request → [`identity::Identity`] (JWT, API key, client IP); pure, no I/O |
//! | [`rules`] | types, `compile` (validation, specificity; `compile/fields` for a rule's penalty, calendar, `count_when`, `cost_from`, `estimate`, failure policy; each limit's spend), `trie` (matching); pure, no I/O |
//! | [`limiter`] | the request's checks and verdict (`check`), algorithms, the [`limiter::Store`] trait, memory and Redis stores (`redis/{conn,protocol,slots,batch}`), key schema (`keys`), deny cache, per-shard breakers, failure policy |
//! | [`http`] | `respond` (every locally made response; the 429 in `respond::limited`), rate-limit headers, forwarding helpers, the upstream (`upstream/{connect,h1,h2,balance}`: connections under the per-target cap, the HTTP/1.1 pool, shared HTTP/2 connections, balancing, ejection and the recent-ejections list) |
//! | [`metrics`] | Prometheus metrics by family (`metrics/{traffic,store,upstream,reload,process,rls}`), each registering its own; handles resolved at rule load |
//! | [`clock`] | injectable time ([`clock::FakeClock`] for tests) |
//! | [`demo`] | `tollgate demo`: an echo upstream plus the gateway on the memory store |
//! | [`rt`] | runtime plumbing apart from the domain code: coarse timers, idle parking of keep-alive connections, per-thread header-value chunks, stop signals, per-thread memos (the last 429); each with its measured gain (see its index) |
//! | [`telemetry`] | OTLP span export (`tracing.otlp`): the request span handed over by `proxy::access`, a bounded queue, the export thread, `tracing-opentelemetry` for background spans |
//! | [`usage`] | numbers at dotted JSON paths in streamed JSON and event-stream bodies (token usage, `max_tokens`): a fixed-size state machine, no buffering; pure, no I/O |
//! | [`log_throttle`] | rate-limited logging of errors that repeat during an outage |
//! | [`describe`] | plain-language descriptions of the loaded config for `check` and the admin API |
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

pub mod activity;
pub mod adaptive;
pub mod admin;
pub mod background;
pub mod clock;
pub mod config;
pub mod demo;
pub mod describe;
pub mod engine;
pub mod http;
pub mod identity;
pub mod limiter;
pub mod log_throttle;
pub mod metrics;
pub mod proxy;
pub mod regions;
pub mod rls;
pub mod rt;
pub mod rules;
pub mod server;
pub mod state;
pub mod telemetry;
pub mod usage;
pub mod yaml;
