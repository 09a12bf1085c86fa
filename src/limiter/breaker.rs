//! A circuit breaker in front of the store, so requests stop paying `store.timeout` while the
//! store is down.
//!
//! Closed: every check goes to the store; `threshold` consecutive failures open it. Open: no
//! check goes to the store; a background probe (see `crate::server`) runs the script path
//! every `probe_interval` and closes the breaker on the first success. Plain atomics: the state
//! is read on every request and must never block.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

/// Breaker state shared by all requests.
#[derive(Debug)]
pub struct Breaker {
    /// Consecutive failures seen while closed.
    failures: AtomicU32,
    /// Failures that open the breaker.
    threshold: u32,
    /// True while open.
    open: AtomicBool,
    /// How many times it opened (metrics).
    opened_total: AtomicU64,
}

impl Breaker {
    /// A closed breaker that opens after `threshold` consecutive failures.
    pub fn new(threshold: u32) -> Self {
        Breaker {
            failures: AtomicU32::new(0),
            threshold: threshold.max(1),
            open: AtomicBool::new(false),
            opened_total: AtomicU64::new(0),
        }
    }

    /// True while open.
    pub fn is_open(&self) -> bool {
        self.open.load(Ordering::Relaxed)
    }

    /// A check succeeded.
    pub fn success(&self) {
        self.failures.store(0, Ordering::Relaxed);
    }

    /// A check failed. Returns true when this failure opened the breaker.
    pub fn failure(&self) -> bool {
        let n = self.failures.fetch_add(1, Ordering::Relaxed) + 1;
        if n >= self.threshold && !self.open.swap(true, Ordering::AcqRel) {
            self.opened_total.fetch_add(1, Ordering::Relaxed);
            return true;
        }
        false
    }

    /// The probe succeeded: close. Returns true when it was open.
    pub fn close(&self) -> bool {
        self.failures.store(0, Ordering::Relaxed);
        self.open.swap(false, Ordering::AcqRel)
    }

    /// How many times the breaker has opened.
    pub fn opened_total(&self) -> u64 {
        self.opened_total.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_after_threshold_and_closes_on_probe() {
        let b = Breaker::new(3);
        assert!(!b.is_open());
        assert!(!b.failure());
        b.success();
        assert!(!b.failure());
        assert!(!b.failure());
        assert!(b.failure(), "third consecutive failure opens");
        assert!(b.is_open());
        assert!(b.close());
        assert!(!b.is_open());
        assert_eq!(b.opened_total(), 1);
    }
}
