//! Waiting for something to happen: poll an observable condition with a short interval until it
//! holds or a deadline passes. Tests never sleep to synchronise; they use these.

use std::future::Future;
use std::time::{Duration, Instant};

/// First pause between two polls; it doubles up to [`MAX_INTERVAL`], so a condition that holds
/// at once costs nothing and a slow one (a cluster failover) is not polled in a busy loop.
const FIRST_INTERVAL: Duration = Duration::from_millis(5);

/// Longest pause between two polls (the precision of what tests measure by polling).
const MAX_INTERVAL: Duration = Duration::from_millis(50);

/// Poll the async `condition` until it returns `Some`, or `timeout` passes (then `None`). The
/// condition is always polled once more at the deadline.
pub async fn eventually_some<T, F, Fut>(timeout: Duration, mut condition: F) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    let mut every = FIRST_INTERVAL;
    loop {
        if let Some(v) = condition().await {
            return Some(v);
        }
        let now = Instant::now();
        if now >= deadline {
            return None;
        }
        tokio::time::sleep(every.min(deadline - now)).await;
        every = (every * 2).min(MAX_INTERVAL);
    }
}

/// Poll the async `condition` until it is true (then `true`), or `timeout` passes (`false`).
pub async fn eventually<F, Fut>(timeout: Duration, mut condition: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    eventually_some(timeout, || {
        let f = condition();
        async move { f.await.then_some(()) }
    })
    .await
    .is_some()
}

/// Blocking [`eventually_some`], for code outside a runtime (process management, `#[test]`s
/// driving the real binary). Never call it on a runtime worker thread.
pub fn eventually_some_blocking<T>(timeout: Duration, mut condition: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + timeout;
    let mut every = FIRST_INTERVAL;
    loop {
        if let Some(v) = condition() {
            return Some(v);
        }
        let now = Instant::now();
        if now >= deadline {
            return None;
        }
        std::thread::sleep(every.min(deadline - now));
        every = (every * 2).min(MAX_INTERVAL);
    }
}

/// Blocking [`eventually`].
pub fn eventually_blocking(timeout: Duration, mut condition: impl FnMut() -> bool) -> bool {
    eventually_some_blocking(timeout, || condition().then_some(())).is_some()
}
