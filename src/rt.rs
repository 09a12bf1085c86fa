//! Runtime plumbing: timers, buffers, idle parking, stop signals and per-thread memos, apart from the domain code.
//! None of it decides anything about a request; each piece makes the request path cheaper than
//! the general-purpose tool it replaces, and rests on one invariant its tests check.
//!
//! | piece | replaces | measured gain | invariant | tests |
//! |---|---|---|---|---|
//! | [`coarse_timer`] | tokio timers for hyper's header-read timeout and the upstream request timeout | 48,990 → 48,421 instructions per proxied request, 18,855 → 18,441 per denied one (`bench/profile`, profiling build) | a deadline never fires early, and late by at most one [`coarse_timer::TICK`] plus the timer thread's wake-up | `coarse_timer::tests`; `tests/proxy.rs` (slow upstream gets 504) |
//! | [`idle`] | hyper's HTTP/1 connection kept, buffers and all, across idle keep-alive gaps | idle keep-alive connection 2.04 KiB instead of hyper's ≈ 16 KiB of buffers (`bench/idle-conns`); parking only after 5 ms idle took the deny path 46.4k → 27.7k instructions | hyper holds no unread bytes when a connection parks (the reader hands it a head up to its blank line and a body up to its `Content-Length`; anything unusual is never parked) | `idle::tests`; `tests/proxy.rs` and `tests/hardening.rs` (pipelining, slowloris, keep-alive) |
//! | [`value_buf`] | one `String` / `Bytes` allocation per header value | 53,481 → 50,882 instructions per proxied request with the forwarding headers' one pass; a 429 from 8 to 6 allocations | a value is a slice of a frozen chunk: nothing written later on the thread changes it | `value_buf::tests`; `http::respond::tests` |
//! | [`stop`] | a `watch::Receiver::changed()` in a `select!` at every wake-up of a connection task | 54,935 → 53,481 instructions per proxied request, with the head's end found by `memchr` and hop-by-hop stripping in one pass | raising the level wakes every registered connection; one registered after it sees it at once | `stop::tests`; `tests/drain.rs` |
//! | [`memo`] | writing the same 429 (body, `Retry-After`, rate-limit values, the RFC 3339 reset time) again for every denial of a flood | 24,388 → 19,302 instructions per denied request (`bench/profile`, when the last 429 was first reused) | a kept value is handed out only while every input it was made from is equal; a nested use finds nothing rather than panicking | `memo::tests`; `http::respond::tests` (a repeated 429 shares the first one's body; any changed input rebuilds it) |
//!
//! The figures and how they were taken are in docs/performance.md.

pub mod coarse_timer;
pub mod idle;
pub mod memo;
pub mod stop;
pub mod value_buf;
