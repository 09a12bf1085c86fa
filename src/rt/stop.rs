//! How one accept loop tells its connections to stop: gracefully (finish what is in flight,
//! then close) and, once `shutdown_grace` has passed, at once.
//!
//! A connection's task polls its stop signal every time it is woken, several times per
//! request. A `watch::Receiver::changed()` future there cost a `Notified` registration, a
//! `select!` and the cooperative budget at every wake-up (measured: `src/rt.rs`), so
//! the signal is an atomic level plus one [`AtomicWaker`] per connection: polling it is an
//! atomic load and a `will_wake` comparison. Each connection registers once, in a slab behind
//! a mutex held only to insert or remove at connect and close (never across an `.await`);
//! raising the level wakes every registered connection.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use futures_util::task::AtomicWaker;
use parking_lot::Mutex;

/// How far the stop has gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Level {
    /// Serving.
    Running = 0,
    /// The drain window (`server.drain`): still serving and accepting, but HTTP/2 connections
    /// get GOAWAY (HTTP/1.1 responses carry `Connection: close`, see `State::draining`); idle
    /// connections stay open.
    Draining = 1,
    /// Finish in-flight requests, then close.
    Graceful = 2,
    /// The grace period passed: drop the connection now.
    Killed = 3,
}

impl Level {
    fn from_u8(v: u8) -> Level {
        match v {
            0 => Level::Running,
            1 => Level::Draining,
            2 => Level::Graceful,
            _ => Level::Killed,
        }
    }
}

/// One accept loop's stop signal, shared by its connections.
#[derive(Default)]
pub(crate) struct StopSignal {
    /// The current [`Level`].
    level: AtomicU8,
    /// The registered connections' wakers.
    waiters: Mutex<Slab>,
}

/// Wakers with O(1) insert and removal (10,000 idle connections register here).
#[derive(Default)]
struct Slab {
    /// Each slot's waker; `None` when the slot is free.
    entries: Vec<Option<Arc<AtomicWaker>>>,
    /// Free slots.
    free: Vec<usize>,
}

impl StopSignal {
    /// A new signal at [`Level::Running`].
    pub(crate) fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Raise the level to `to` (never lowers it) and wake every connection.
    pub(crate) fn raise(&self, to: Level) {
        self.level.fetch_max(to as u8, Ordering::SeqCst);
        let waiters = self.waiters.lock();
        for w in waiters.entries.iter().flatten() {
            w.wake();
        }
    }

    /// The current level.
    pub(crate) fn level(&self) -> Level {
        Level::from_u8(self.level.load(Ordering::SeqCst))
    }

    /// Register a connection: the watch it polls.
    pub(crate) fn watch(self: &Arc<Self>) -> StopWatch {
        let waker = Arc::new(AtomicWaker::new());
        let slot = {
            let mut w = self.waiters.lock();
            match w.free.pop() {
                Some(i) => {
                    w.entries[i] = Some(waker.clone());
                    i
                }
                None => {
                    w.entries.push(Some(waker.clone()));
                    w.entries.len() - 1
                }
            }
        };
        StopWatch {
            signal: self.clone(),
            waker,
            slot,
        }
    }
}

/// One connection's view of its accept loop's [`StopSignal`]; unregisters on drop.
pub(crate) struct StopWatch {
    /// The accept loop's signal this connection registered with.
    signal: Arc<StopSignal>,
    /// Woken when the level rises.
    waker: Arc<AtomicWaker>,
    /// This watch's slot in the signal's slab.
    slot: usize,
}

impl StopWatch {
    /// The current level; `cx` is woken when it rises later.
    pub(crate) fn poll_level(&self, cx: &mut Context<'_>) -> Level {
        let now = self.signal.level();
        if now == Level::Killed {
            return now;
        }
        // Register first, then look again: a raise between the two is seen by the second
        // look, a later one wakes the registered waker.
        self.waker.register(cx.waker());
        self.signal.level()
    }

    /// The current level, without registering for a wake-up.
    pub(crate) fn level(&self) -> Level {
        self.signal.level()
    }

    /// Wait until the level is at least `at`.
    pub(crate) async fn reached(&self, at: Level) {
        std::future::poll_fn(|cx| {
            if self.poll_level(cx) >= at {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await
    }
}

impl Drop for StopWatch {
    fn drop(&mut self) {
        let mut w = self.signal.waiters.lock();
        if let Some(e) = w.entries.get_mut(self.slot) {
            *e = None;
            w.free.push(self.slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_raise_wakes_every_watch_and_slots_are_reused() {
        let s = StopSignal::new();
        let a = s.watch();
        let b = s.watch();
        assert_eq!((a.slot, b.slot), (0, 1));
        let waiting = tokio::spawn({
            let s = s.clone();
            async move {
                let w = s.watch();
                w.reached(Level::Graceful).await;
                s.level()
            }
        });
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished());
        s.raise(Level::Graceful);
        assert_eq!(waiting.await.ok(), Some(Level::Graceful));
        // Never lowered.
        s.raise(Level::Running);
        assert_eq!(s.level(), Level::Graceful);
        drop(a);
        let c = s.watch();
        assert_eq!(c.slot, 0, "a freed slot is taken again");
        s.raise(Level::Killed);
        c.reached(Level::Killed).await;
    }
}
