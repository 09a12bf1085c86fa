//! Rate-limited logging for errors that repeat while something is down (the store, the
//! upstream): the first occurrence is logged at once, then at most one line per interval, each
//! saying how many occurrences it stands for. An outage then costs a few log lines, not one per
//! request or per retry.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// One throttle per kind of repeated error.
#[derive(Debug)]
pub struct LogThrottle {
    /// Minimum time between two logged lines, in ms.
    interval_ms: u64,
    /// The earliest time (ms since `epoch`) the next line may be logged.
    next_ms: AtomicU64,
    /// Occurrences not logged since the last logged one.
    suppressed: AtomicU64,
    /// Origin of `next_ms`.
    epoch: Instant,
}

impl LogThrottle {
    /// At most one line per `interval`.
    pub fn new(interval: Duration) -> Self {
        LogThrottle {
            interval_ms: u64::try_from(interval.as_millis()).unwrap_or(u64::MAX),
            next_ms: AtomicU64::new(0),
            suppressed: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }

    /// Count one occurrence. `Some(n)` when it should be logged, `n` being how many earlier
    /// occurrences were not; `None` when it should not.
    pub fn allow(&self) -> Option<u64> {
        let now = u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
        let next = self.next_ms.load(Ordering::Relaxed);
        if now >= next
            && self
                .next_ms
                .compare_exchange(
                    next,
                    now.saturating_add(self.interval_ms),
                    Ordering::AcqRel,
                    Ordering::Relaxed,
                )
                .is_ok()
        {
            return Some(self.suppressed.swap(0, Ordering::Relaxed));
        }
        self.suppressed.fetch_add(1, Ordering::Relaxed);
        None
    }

    /// The trouble is over: the next occurrence is logged at once. Returns how many
    /// occurrences went unlogged.
    pub fn reset(&self) -> u64 {
        self.next_ms.store(0, Ordering::Relaxed);
        self.suppressed.swap(0, Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_is_logged_then_one_per_interval_with_the_count() {
        let t = LogThrottle::new(Duration::from_secs(3600));
        assert_eq!(t.allow(), Some(0));
        for _ in 0..1000 {
            assert_eq!(t.allow(), None);
        }
        assert_eq!(t.reset(), 1000);
        assert_eq!(t.allow(), Some(0));
        let t = LogThrottle::new(Duration::ZERO);
        assert_eq!(t.allow(), Some(0));
        assert_eq!(t.allow(), Some(0));
    }
}
