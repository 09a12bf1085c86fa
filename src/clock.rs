//! Injectable time.
//!
//! Every algorithm works on integer microseconds since the Unix epoch, the same unit the Lua
//! scripts derive from Redis `TIME`, so the memory store and Redis agree to the microsecond.
//! Tests use [`FakeClock`] and advance it instead of sleeping.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

/// A source of wall-clock time in microseconds since the Unix epoch.
pub trait Clock: Send + Sync + 'static {
    /// The current time in microseconds since the Unix epoch.
    fn now_us(&self) -> u64;
}

/// The real clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_us(&self) -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_micros() as u64)
            .unwrap_or(0)
    }
}

/// A clock that only moves when told to. Cloning shares the same time.
#[derive(Debug, Clone, Default)]
pub struct FakeClock {
    /// Current time in microseconds, shared by every clone.
    now: Arc<AtomicU64>,
}

impl FakeClock {
    /// A fake clock that reads `start_us`.
    pub fn new(start_us: u64) -> Self {
        Self {
            now: Arc::new(AtomicU64::new(start_us)),
        }
    }

    /// Move the clock forward by `us` microseconds.
    pub fn advance_us(&self, us: u64) {
        self.now.fetch_add(us, Ordering::SeqCst);
    }

    /// Move the clock forward by `ms` milliseconds.
    pub fn advance_ms(&self, ms: u64) {
        self.advance_us(ms * 1000);
    }

    /// Set the clock to `us` microseconds since the epoch.
    pub fn set_us(&self, us: u64) {
        self.now.store(us, Ordering::SeqCst);
    }
}

impl Clock for FakeClock {
    fn now_us(&self) -> u64 {
        self.now.load(Ordering::SeqCst)
    }
}

/// A shared, dynamically chosen clock.
pub type SharedClock = Arc<dyn Clock>;
