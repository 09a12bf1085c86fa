//! Coarse deadlines for the request path: hyper's header-read timeout and the upstream
//! request timeout, both far longer than a millisecond and almost always cancelled.
//!
//! A tokio timer costs each request a registration in the runtime's timer wheel, a lock of its
//! driver on the way in and out and a fresh `Sleep` (hyper boxes one per request head), for
//! two deadlines per proxied request (measured: `src/rt.rs`). Here a deadline is
//! an entry in a wheel of [`TICK`]-long buckets, each a doubly linked list in a slab, behind a
//! `parking_lot` mutex held for a link change (never across an `.await`):
//! registering and cancelling are each a lock, a link change and an unlock, and a poll before
//! the deadline is an atomic load. There is one wheel per core (a thread keeps to one), so
//! thread-per-core workers never contend for a lock or share a cache line here. A thread of
//! its own ("tollgate-timer") advances every wheel each tick while any deadline is registered
//! and sleeps otherwise; it wakes the expired deadlines' tasks from outside their runtime, so
//! the wheels serve every runtime (the thread-per-core workers, the work-stealing pool, and
//! each test's own runtime).
//!
//! A deadline fires at the first tick at or after it: never early, and late by at most one
//! [`TICK`] plus the wake-up of the timer thread.

use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

/// The wheel's resolution.
pub const TICK: Duration = Duration::from_millis(4);

/// Buckets in the wheel (a deadline further away than this many ticks waits a turn or more).
const BUCKETS: usize = 4096;

/// No entry (the end of a bucket's list).
const NONE: u32 = u32::MAX;

/// The tick of a deadline that never fires.
const NEVER: u64 = u64::MAX;

/// [`TICK`] in nanoseconds.
const TICK_NANOS: u64 = TICK.as_nanos() as u64;

/// `d` in nanoseconds (saturating: 584 years).
fn nanos(d: Duration) -> u64 {
    d.as_secs()
        .saturating_mul(1_000_000_000)
        .saturating_add(u64::from(d.subsec_nanos()))
}

/// One registered deadline.
struct Entry {
    /// Its tick (ticks since the wheel's epoch).
    tick: u64,
    /// The task to wake.
    waker: Option<Waker>,
    /// Neighbours in its bucket's list.
    prev: u32,
    /// See `prev`.
    next: u32,
    /// Bumped each time the slot is freed, so a stale handle is told from its slot's new owner.
    generation: u32,
}

/// The wheel proper (behind the mutex).
struct Wheel {
    /// Every entry, live or free.
    slab: Vec<Entry>,
    /// Free slots.
    free: Vec<u32>,
    /// Each bucket's first entry.
    heads: Vec<u32>,
    /// Live entries.
    live: usize,
    /// The last tick whose bucket was processed.
    done: u64,
}

/// One shard of the wheel: its buckets, and the count the timer thread reads without the lock.
struct Shard {
    /// The wheel proper.
    wheel: Mutex<Wheel>,
    /// `wheel.live`, mirrored for the timer thread's "is anything registered" check.
    live: AtomicUsize,
}

/// The process-wide timer: one wheel per shard, each behind its own mutex. A thread keeps to
/// one shard (given round-robin on its first deadline), so the workers of a thread-per-core
/// server each lock a mutex of their own and no cache line is shared between them on the
/// request path; only the timer thread visits every shard, once a tick. A deadline remembers
/// its shard, so a task that moves between threads (work-stealing) cancels it where it lives.
struct Timer {
    /// Instants count from here.
    epoch: Instant,
    /// One wheel per shard, so timers on different threads rarely share a lock.
    shards: Box<[Shard]>,
    /// Set (under this mutex) when a deadline lands in an empty shard, so the sleeping timer
    /// thread cannot miss it between its check and its wait.
    pending: Mutex<bool>,
    /// Woken with `pending`.
    work: Condvar,
    /// The last tick the timer thread processed: a deadline at or before it has fired.
    now_tick: AtomicU64,
}

/// Hands each thread its shard.
static NEXT_SHARD: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// This thread's shard, once it registered a deadline (`usize::MAX` before).
    static MY_SHARD: Cell<usize> = const { Cell::new(usize::MAX) };
}

fn timer() -> &'static Timer {
    static T: OnceLock<&'static Timer> = OnceLock::new();
    T.get_or_init(|| {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, 64);
        let shards = (0..n)
            .map(|_| Shard {
                wheel: Mutex::new(Wheel {
                    slab: Vec::new(),
                    free: Vec::new(),
                    heads: vec![NONE; BUCKETS],
                    live: 0,
                    done: 0,
                }),
                live: AtomicUsize::new(0),
            })
            .collect();
        let t: &'static Timer = Box::leak(Box::new(Timer {
            epoch: Instant::now(),
            shards,
            pending: Mutex::new(false),
            work: Condvar::new(),
            now_tick: AtomicU64::new(0),
        }));
        let spawned = std::thread::Builder::new()
            .name("tollgate-timer".into())
            .spawn(move || t.run());
        if let Err(e) = spawned {
            // Without the thread no deadline fires: requests still end when the client or the
            // upstream does. Say so loudly.
            tracing::error!(error = %e, "cannot start the timer thread: request deadlines will not fire");
        }
        t
    })
}

impl Timer {
    /// Ticks from the epoch to `at`, rounded up (a deadline never fires early).
    fn tick_of(&self, at: Instant) -> u64 {
        nanos(at.saturating_duration_since(self.epoch)).div_ceil(TICK_NANOS)
    }

    /// The tick now, rounded down.
    fn tick_now(&self) -> u64 {
        nanos(self.epoch.elapsed()) / TICK_NANOS
    }

    /// The calling thread's shard.
    fn my_shard(&self) -> usize {
        MY_SHARD
            .try_with(|s| {
                if s.get() == usize::MAX {
                    s.set(NEXT_SHARD.fetch_add(1, Ordering::Relaxed) % self.shards.len());
                }
                s.get()
            })
            .unwrap_or(0)
    }

    /// Register a deadline at `tick` that wakes `waker`: its shard, slot and generation, or
    /// `None` when the tick has already been processed (the deadline is due).
    fn insert(&self, tick: u64, waker: &Waker) -> Option<(u32, u32, u32)> {
        let si = self.my_shard();
        let shard = &self.shards[si];
        let mut w = shard.wheel.lock();
        if w.live == 0 {
            // This shard held nothing: the ticks the thread skipped (or slept through) held
            // nothing of it either.
            let skipped = self.tick_now().saturating_sub(1);
            if skipped > w.done {
                w.done = skipped;
                self.now_tick.fetch_max(skipped, Ordering::AcqRel);
            }
        }
        if tick <= w.done {
            return None;
        }
        let idx = match w.free.pop() {
            Some(i) => i,
            None => {
                let i = u32::try_from(w.slab.len()).ok().filter(|&i| i < NONE)?;
                w.slab.push(Entry {
                    tick: 0,
                    waker: None,
                    prev: NONE,
                    next: NONE,
                    generation: 0,
                });
                i
            }
        };
        let bucket = (tick % BUCKETS as u64) as usize;
        let head = w.heads[bucket];
        if let Some(h) = w.slab.get_mut(head as usize) {
            h.prev = idx;
        }
        let e = &mut w.slab[idx as usize];
        e.tick = tick;
        e.waker = Some(waker.clone());
        e.prev = NONE;
        e.next = head;
        let generation = e.generation;
        w.heads[bucket] = idx;
        w.live += 1;
        shard.live.store(w.live, Ordering::Release);
        let first = w.live == 1;
        drop(w);
        if first {
            // After the shard's lock is released: the timer thread takes `pending` and then the
            // shards, never the other way round.
            *self.pending.lock() = true;
            self.work.notify_one();
        }
        Some((si as u32, idx, generation))
    }

    /// Unlink entry `idx` (live, generation checked by the caller) and free its slot.
    fn remove_at(w: &mut Wheel, idx: u32) -> Option<Waker> {
        let (prev, next, tick) = {
            let e = &w.slab[idx as usize];
            (e.prev, e.next, e.tick)
        };
        match w.slab.get_mut(prev as usize) {
            Some(p) => p.next = next,
            None => w.heads[(tick % BUCKETS as u64) as usize] = next,
        }
        if let Some(n) = w.slab.get_mut(next as usize) {
            n.prev = prev;
        }
        let e = &mut w.slab[idx as usize];
        e.generation = e.generation.wrapping_add(1);
        e.prev = NONE;
        e.next = NONE;
        let waker = e.waker.take();
        w.free.push(idx);
        w.live -= 1;
        waker
    }

    /// Cancel the deadline `(shard, idx, generation)` if it has not fired.
    fn cancel(&self, shard: u32, idx: u32, generation: u32) {
        let Some(shard) = self.shards.get(shard as usize) else {
            return;
        };
        let mut w = shard.wheel.lock();
        if w.slab.get(idx as usize).is_some_and(|e| e.generation == generation) {
            let _waker = Self::remove_at(&mut w, idx);
            shard.live.store(w.live, Ordering::Release);
        }
    }

    /// Point the deadline `(shard, idx, generation)` at another task. `false` when it has
    /// fired already (its slot moved on): the caller must not wait for a wake-up.
    fn rewake(&self, shard: u32, idx: u32, generation: u32, waker: &Waker) -> bool {
        let Some(shard) = self.shards.get(shard as usize) else {
            return false;
        };
        let mut w = shard.wheel.lock();
        match w.slab.get_mut(idx as usize).filter(|e| e.generation == generation) {
            Some(e) => {
                e.waker = Some(waker.clone());
                true
            }
            None => false,
        }
    }

    /// The timer thread: every tick, fire the deadlines that are due in every shard; sleep
    /// while no shard holds any.
    fn run(&self) {
        let mut due: Vec<Waker> = Vec::new();
        loop {
            {
                let mut pending = self.pending.lock();
                while !*pending && self.shards.iter().all(|s| s.live.load(Ordering::Acquire) == 0) {
                    self.work.wait(&mut pending);
                }
                *pending = false;
            }
            let now = self.tick_now();
            for shard in self.shards.iter() {
                let mut w = shard.wheel.lock();
                if w.live > 0 {
                    // At most one turn of the wheel per pass: every bucket once.
                    let from = w.done.saturating_add(1).max(now.saturating_sub(BUCKETS as u64 - 1));
                    for t in from..=now {
                        let mut i = w.heads[(t % BUCKETS as u64) as usize];
                        while i != NONE {
                            let (next, tick) = {
                                let e = &w.slab[i as usize];
                                (e.next, e.tick)
                            };
                            if tick <= now {
                                due.extend(Self::remove_at(&mut w, i));
                            }
                            i = next;
                        }
                    }
                    shard.live.store(w.live, Ordering::Release);
                }
                w.done = w.done.max(now);
            }
            self.now_tick.fetch_max(now, Ordering::AcqRel);
            for waker in due.drain(..) {
                waker.wake();
            }
            std::thread::sleep(TICK);
        }
    }

    /// Live deadlines in every shard (for tests).
    #[cfg(test)]
    fn live(&self) -> usize {
        self.shards.iter().map(|s| s.wheel.lock().live).sum()
    }
}

/// A coarse deadline: a future that completes at (or up to a [`TICK`] after) its instant.
pub struct Deadline {
    /// The tick (of [`TICK`] each, from the epoch) at which it completes.
    tick: u64,
    /// Its entry, once registered (shard, slot, generation), and the waker stored there.
    entry: Option<(u32, u32, u32, Waker)>,
}

impl Deadline {
    /// A deadline at `at`.
    pub fn at(at: Instant) -> Self {
        Deadline {
            tick: timer().tick_of(at),
            entry: None,
        }
    }

    /// A deadline `after` from now; one too far to name (`Instant` overflows) never fires.
    pub fn after(after: Duration) -> Self {
        match Instant::now().checked_add(after) {
            Some(at) => Self::at(at),
            None => Deadline {
                tick: NEVER,
                entry: None,
            },
        }
    }

    /// Move the deadline to `at` (cancelling the registration it had).
    pub fn reset(&mut self, at: Instant) {
        self.cancel();
        self.tick = timer().tick_of(at);
    }

    fn cancel(&mut self) {
        if let Some((shard, idx, generation, _)) = self.entry.take() {
            timer().cancel(shard, idx, generation);
        }
    }
}

impl Future for Deadline {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        if this.tick == NEVER {
            return Poll::Pending;
        }
        let t = timer();
        if t.now_tick.load(Ordering::Acquire) >= this.tick {
            this.cancel();
            return Poll::Ready(());
        }
        match &mut this.entry {
            None => match t.insert(this.tick, cx.waker()) {
                Some((shard, idx, generation)) => this.entry = Some((shard, idx, generation, cx.waker().clone())),
                // The thread passed the tick between the load above and the insert.
                None => return Poll::Ready(()),
            },
            Some((shard, idx, generation, w)) if !w.will_wake(cx.waker()) => {
                if !t.rewake(*shard, *idx, *generation, cx.waker()) {
                    // It fired between the load above and the lock, waking the old task.
                    this.entry = None;
                    return Poll::Ready(());
                }
                *w = cx.waker().clone();
            }
            Some(_) => {}
        }
        Poll::Pending
    }
}

impl Drop for Deadline {
    fn drop(&mut self) {
        self.cancel();
    }
}

/// The future's output, or `Err` once `limit` has passed.
pub async fn timeout<F: Future>(limit: Duration, fut: F) -> Result<F::Output, Elapsed> {
    let mut fut = std::pin::pin!(fut);
    let mut deadline = Deadline::after(limit);
    std::future::poll_fn(|cx| {
        if let Poll::Ready(v) = fut.as_mut().poll(cx) {
            return Poll::Ready(Ok(v));
        }
        match Pin::new(&mut deadline).poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(Elapsed)),
            Poll::Pending => Poll::Pending,
        }
    })
    .await
}

/// A [`timeout`] passed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Elapsed;

/// [`Deadline`]s for hyper (`hyper::rt::Timer`): its HTTP/1.1 header-read timeout.
#[derive(Debug, Clone, Copy, Default)]
pub struct CoarseTimer;

impl hyper::rt::Sleep for Deadline {}

impl hyper::rt::Timer for CoarseTimer {
    fn sleep(&self, duration: Duration) -> Pin<Box<dyn hyper::rt::Sleep>> {
        Box::pin(Deadline::after(duration))
    }

    fn sleep_until(&self, deadline: Instant) -> Pin<Box<dyn hyper::rt::Sleep>> {
        Box::pin(Deadline::at(deadline))
    }

    fn reset(&self, sleep: &mut Pin<Box<dyn hyper::rt::Sleep>>, new_deadline: Instant) {
        match sleep.as_mut().downcast_mut_pin::<Deadline>() {
            Some(d) => d.get_mut().reset(new_deadline),
            None => *sleep = self.sleep_until(new_deadline),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_deadline_fires_after_its_instant_and_not_before() {
        let start = Instant::now();
        Deadline::after(Duration::from_millis(30)).await;
        let waited = start.elapsed();
        assert!(waited >= Duration::from_millis(30), "early: {waited:?}");
        assert!(waited < Duration::from_millis(500), "late: {waited:?}");
    }

    #[tokio::test]
    async fn timeout_gives_the_output_or_elapsed() {
        assert_eq!(timeout(Duration::from_secs(5), async { 7 }).await, Ok(7));
        let slow = timeout(Duration::from_millis(20), std::future::pending::<()>()).await;
        assert_eq!(slow, Err(Elapsed));
    }

    #[tokio::test]
    async fn cancelled_deadlines_free_their_slots_and_never_fire() {
        // Many deadlines, most dropped before their time: the slab reuses the freed slots, and
        // the survivors still fire.
        for _ in 0..100 {
            let mut d = Deadline::after(Duration::from_secs(60));
            let waker = futures_util::task::noop_waker();
            let mut cx = Context::from_waker(&waker);
            assert!(Pin::new(&mut d).poll(&mut cx).is_pending());
        }
        let live = timer().live();
        assert!(live < 100, "dropped deadlines stay registered: {live}");
        let (a, b) = tokio::join!(
            timeout(Duration::from_millis(10), std::future::pending::<()>()),
            timeout(Duration::from_millis(40), std::future::pending::<()>())
        );
        assert_eq!((a, b), (Err(Elapsed), Err(Elapsed)));
    }

    #[tokio::test]
    async fn a_timeout_too_long_to_name_never_fires_and_never_panics() {
        // `Instant::now() + Duration::MAX` overflows; a configured `request_timeout` that large
        // must mean "no deadline", not a panic on every request.
        assert_eq!(timeout(Duration::MAX, async { 7 }).await, Ok(7));
        let mut d = Deadline::after(Duration::MAX);
        let waker = futures_util::task::noop_waker();
        assert!(Pin::new(&mut d).poll(&mut Context::from_waker(&waker)).is_pending());
    }

    #[test]
    fn a_deadline_registered_on_one_thread_is_cancelled_from_another() {
        // A work-stealing runtime moves tasks between threads: the deadline keeps its shard.
        let mut d = Deadline::after(Duration::from_secs(60));
        let waker = futures_util::task::noop_waker();
        assert!(Pin::new(&mut d).poll(&mut Context::from_waker(&waker)).is_pending());
        let shard = d.entry.as_ref().map(|e| e.0);
        let (live_shard, idx, generation) = d.entry.as_ref().map(|e| (e.0, e.1, e.2)).unwrap_or_default();
        std::thread::spawn(move || drop(d)).join().unwrap_or_default();
        let w = timer().shards[live_shard as usize].wheel.lock();
        assert!(shard.is_some(), "the deadline was registered");
        assert!(
            w.slab.get(idx as usize).is_none_or(|e| e.generation != generation),
            "cancelled from another thread, the entry is freed in its own shard"
        );
    }

    #[test]
    fn hyper_resets_its_sleep_in_place() {
        use hyper::rt::Timer;
        let t = CoarseTimer;
        let mut s = t.sleep(Duration::from_secs(60));
        let later = Instant::now() + Duration::from_secs(120);
        t.reset(&mut s, later);
        assert!(s.as_mut().downcast_mut_pin::<Deadline>().is_some());
    }
}
