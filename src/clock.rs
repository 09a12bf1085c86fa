//! Injectable time.
//!
//! Every algorithm works on integer microseconds since the Unix epoch, the same unit the Lua
//! scripts derive from Redis `TIME`, so the memory store and Redis agree to the microsecond.
//! Tests use [`FakeClock`] and advance it instead of sleeping.
//!
//! Besides the wall clock, every [`Clock`] has a monotonic reading ([`Clock::mono_us`]) for
//! local lifetimes (a lease's life): the wall clock may step back or forward, the monotonic one
//! never does.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::sync::OnceLock;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// A source of wall-clock time in microseconds since the Unix epoch, and of monotonic time.
pub trait Clock: Send + Sync + 'static {
    /// The current time in microseconds since the Unix epoch.
    fn now_us(&self) -> u64;

    /// A monotonic reading in microseconds from an arbitrary origin fixed for the process:
    /// it never decreases, and a step of the wall clock does not move it. Only differences
    /// of two readings mean anything.
    fn mono_us(&self) -> u64;
}

/// The origin of [`SystemClock::mono_us`]: the first reading in this process.
fn mono_origin() -> Instant {
    static ORIGIN: OnceLock<Instant> = OnceLock::new();
    *ORIGIN.get_or_init(Instant::now)
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

    fn mono_us(&self) -> u64 {
        u64::try_from(mono_origin().elapsed().as_micros()).unwrap_or(u64::MAX)
    }
}

/// A clock that only moves when told to. Cloning shares the same time.
///
/// Its monotonic reading starts at 0 and moves forward with the wall time; setting the wall
/// time back ([`FakeClock::set_us`]) leaves it where it is, as a real clock step would.
#[derive(Debug, Clone, Default)]
pub struct FakeClock {
    /// Current time in microseconds, shared by every clone.
    now: Arc<AtomicU64>,
    /// The monotonic reading, shared by every clone.
    mono: Arc<AtomicU64>,
}

impl FakeClock {
    /// A fake clock that reads `start_us`.
    pub fn new(start_us: u64) -> Self {
        Self {
            now: Arc::new(AtomicU64::new(start_us)),
            mono: Arc::new(AtomicU64::new(0)),
        }
    }

    /// Move the clock (wall and monotonic) forward by `us` microseconds.
    pub fn advance_us(&self, us: u64) {
        self.now.fetch_add(us, Ordering::SeqCst);
        self.mono.fetch_add(us, Ordering::SeqCst);
    }

    /// Move the clock forward by `ms` milliseconds.
    pub fn advance_ms(&self, ms: u64) {
        self.advance_us(ms * 1000);
    }

    /// Set the wall clock to `us` microseconds since the epoch. A step forward moves the
    /// monotonic reading by as much; a step back leaves it alone (a clock stepped back).
    pub fn set_us(&self, us: u64) {
        let before = self.now.swap(us, Ordering::SeqCst);
        if us > before {
            self.mono.fetch_add(us - before, Ordering::SeqCst);
        }
    }
}

impl Clock for FakeClock {
    fn now_us(&self) -> u64 {
        self.now.load(Ordering::SeqCst)
    }

    fn mono_us(&self) -> u64 {
        self.mono.load(Ordering::SeqCst)
    }
}

/// A shared, dynamically chosen clock.
pub type SharedClock = Arc<dyn Clock>;
