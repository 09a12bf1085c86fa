//! Adaptive concurrency (ARCHITECTURE.md, "Adaptive concurrency"): a per-node limit on the
//! requests in flight to the upstream, learned from the latencies this gateway measures
//! ([`control`]), with priority classes that are refused lowest first.
//!
//! - A request takes a [`Permit`] before it is forwarded and gives it back when the upstream's
//!   response head arrives (or the exchange fails); the time between is its latency sample.
//! - With no room, a request waits for at most its class's `queue_timeout`. Room that frees goes
//!   to the highest class waiting. Within a class without a guaranteed share it goes to the
//!   newest waiter, so under overload the requests admitted from the queue have waited least
//!   and those left behind are refused when their time is up; within a class with a share
//!   (which is meant to be served) to the oldest, so a burst after a stall is served in order
//!   and none of it times out while newer requests go first.
//! - A full queue makes room for a higher class by refusing the newest waiter of the lowest
//!   class below it; a request with nothing below it is refused at once.
//! - Each class may have a guaranteed share of the limit: the other classes cannot take the
//!   part of it that class is not using.
//!
//! No lock is held across an `.await`; everything under the lock is a few comparisons, plus a
//! median over one window's latencies once a window.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::oneshot;

mod config;
mod control;
pub mod raw;
#[cfg(test)]
mod tests;

pub use config::{rule_classes, AdaptiveConfig, Algorithm, Class, NO_CLASS};
pub use control::{Controller, Tuning, WindowSummary, FLOOR_WINDOWS_TO_RELEARN, SLOW_WINDOWS_TO_SHRINK};

/// Most latencies one window keeps (the median is taken over these).
const WINDOW_SAMPLES: usize = 4096;

/// Points of limit-and-in-flight history kept for the dashboard (one a second).
const HISTORY: usize = 120;

/// Why a request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// It waited its class's `queue_timeout` and no room came.
    Timeout,
    /// The queue was full (it was the lowest class waiting, or made room for a higher one).
    QueueFull,
}

impl Refusal {
    /// Its metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Refusal::Timeout => "queue_timeout",
            Refusal::QueueFull => "queue_full",
        }
    }
}

/// The counters and gauges the limiter keeps current (registered by `metrics::Adaptive`).
#[derive(Debug, Clone, Default)]
pub struct Gauges {
    /// The limit.
    pub limit: prometheus_client::metrics::gauge::Gauge,
    /// Requests in flight under it.
    pub in_flight: prometheus_client::metrics::gauge::Gauge,
    /// Requests waiting for room.
    pub queued: prometheus_client::metrics::gauge::Gauge,
    /// The last window's median latency, seconds.
    pub latency: prometheus_client::metrics::gauge::Gauge<f64, std::sync::atomic::AtomicU64>,
    /// The learned no-load latency, seconds.
    pub baseline: prometheus_client::metrics::gauge::Gauge<f64, std::sync::atomic::AtomicU64>,
    /// Per class: admitted, then refused for a timeout, then refused for a full queue.
    pub per_class: Vec<[prometheus_client::metrics::counter::Counter; 3]>,
}

/// One waiting request.
struct Waiter {
    id: u64,
    tx: oneshot::Sender<()>,
}

/// The window being measured.
struct Window {
    started: Instant,
    samples: Vec<u32>,
    failed: u32,
    peak: u32,
    pressure: bool,
}

impl Window {
    fn new(now: Instant) -> Self {
        Window {
            started: now,
            samples: Vec::new(),
            failed: 0,
            peak: 0,
            pressure: false,
        }
    }
}

/// Everything behind the lock.
struct Inner {
    ctl: Controller,
    in_flight: u32,
    by_class: Vec<u32>,
    waiting: Vec<VecDeque<Waiter>>,
    queued: usize,
    next_id: u64,
    window: Window,
    last_median_us: Option<f64>,
    /// Per second: (unix second, limit, most in flight).
    history: VecDeque<(u64, u32, u32)>,
    admitted: Vec<u64>,
    refused: Vec<u64>,
}

impl Inner {
    /// Slots class `k` is guaranteed at `limit`: its share of the limit rounded down, but at
    /// least one for a class with a share while the limit holds one for every such class and
    /// one more besides (a fifth of a limit of 4 keeps one slot, not none; a limit of 1 keeps
    /// none, so the classes without a share are never shut out).
    fn guaranteed(classes: &[Class], k: usize, limit: u32) -> u32 {
        let share = |g: f64| (g * f64::from(limit)).floor() as u32;
        let g = classes.get(k).map_or(0.0, |c| c.guaranteed);
        let slots = share(g);
        if g <= 0.0 || slots >= 1 {
            return slots;
        }
        let kept: u32 = classes
            .iter()
            .filter(|c| c.guaranteed > 0.0)
            .map(|c| share(c.guaranteed).max(1))
            .sum();
        u32::from(kept < limit)
    }

    /// There is room for one more request of `class`.
    fn admissible(&self, classes: &[Class], class: usize) -> bool {
        let limit = self.ctl.limit();
        if self.in_flight >= limit {
            return false;
        }
        let held = self.by_class.get(class).copied().unwrap_or(0);
        if held < Self::guaranteed(classes, class, limit) {
            return true;
        }
        let kept_for_others: u32 = (0..classes.len())
            .filter(|k| *k != class)
            .map(|k| Self::guaranteed(classes, k, limit).saturating_sub(self.by_class[k]))
            .sum();
        self.in_flight + kept_for_others < limit
    }

    fn take(&mut self, class: usize) {
        self.in_flight += 1;
        self.by_class[class] += 1;
        self.admitted[class] += 1;
        self.window.peak = self.window.peak.max(self.in_flight);
    }

    /// Hand free room to waiters: highest class first; within a class, oldest first for a class
    /// with a guaranteed share (it is meant to be served, so the waiter nearest its timeout
    /// goes first) and newest first for the others (under overload, the waiters admitted are
    /// those that waited least, and the ones left behind time out).
    fn grant(&mut self, classes: &[Class]) {
        for class in 0..classes.len() {
            let oldest_first = classes[class].guaranteed > 0.0;
            while !self.waiting[class].is_empty() && self.admissible(classes, class) {
                let next = if oldest_first {
                    self.waiting[class].pop_front()
                } else {
                    self.waiting[class].pop_back()
                };
                let Some(w) = next else { break };
                self.queued -= 1;
                if w.tx.send(()).is_ok() {
                    self.take(class);
                }
            }
        }
    }

    /// Refuse the newest waiter of the lowest class below `class`; false when there is none.
    fn evict_below(&mut self, class: usize) -> bool {
        for k in (class + 1..self.waiting.len()).rev() {
            if let Some(w) = self.waiting[k].pop_back() {
                self.queued -= 1;
                drop(w.tx);
                return true;
            }
        }
        false
    }
}

/// The adaptive limiter of one upstream on this node.
pub struct Adaptive {
    cfg: AdaptiveConfig,
    inner: Mutex<Inner>,
    gauges: Gauges,
}

impl std::fmt::Debug for Adaptive {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Adaptive")
            .field("cfg", &self.cfg)
            .finish_non_exhaustive()
    }
}

impl Adaptive {
    /// A limiter at `cfg`'s initial limit, keeping `gauges` current (its `per_class` is
    /// padded to the classes).
    pub fn new(cfg: AdaptiveConfig, mut gauges: Gauges) -> Arc<Self> {
        let n = cfg.classes.len();
        gauges.per_class.resize_with(n, Default::default);
        let inner = Inner {
            ctl: Controller::new(cfg.tuning, cfg.initial),
            in_flight: 0,
            by_class: vec![0; n],
            waiting: (0..n).map(|_| VecDeque::new()).collect(),
            queued: 0,
            next_id: 0,
            window: Window::new(Instant::now()),
            last_median_us: None,
            history: VecDeque::with_capacity(HISTORY),
            admitted: vec![0; n],
            refused: vec![0; n],
        };
        gauges.limit.set(i64::from(inner.ctl.limit()));
        Arc::new(Adaptive {
            cfg,
            inner: Mutex::new(inner),
            gauges,
        })
    }

    /// Its config.
    pub fn config(&self) -> &AdaptiveConfig {
        &self.cfg
    }

    /// The name of class `class`.
    pub fn class_name(&self, class: usize) -> Arc<str> {
        self.cfg
            .classes
            .get(class)
            .map_or_else(|| Arc::from("default"), |c| c.name.clone())
    }

    /// Room for one request of `class` (clamped to the classes): at once, after waiting up to
    /// its class's `queue_timeout`, or a refusal. Dropped while it waits (its client left), it
    /// leaves the queue, and room granted to it meanwhile goes to the next waiter.
    pub async fn acquire(self: &Arc<Self>, class: usize) -> Result<Permit, Refusal> {
        let class = class.min(self.cfg.classes.len().saturating_sub(1));
        let timeout = self.cfg.classes[class].queue_timeout;
        let (rx, id) = {
            let mut g = self.inner.lock();
            if g.admissible(&self.cfg.classes, class) {
                g.take(class);
                self.publish(&g);
                drop(g);
                self.gauges.per_class[class][0].inc();
                return Ok(self.permit(class));
            }
            g.window.pressure = true;
            if timeout.is_zero() || (g.queued >= self.cfg.max_queue && !g.evict_below(class)) {
                return Err(self.refused(&mut g, class, Refusal::QueueFull));
            }
            let (tx, rx) = oneshot::channel();
            let id = g.next_id;
            g.next_id += 1;
            g.waiting[class].push_back(Waiter { id, tx });
            g.queued += 1;
            self.publish(&g);
            (rx, id)
        };
        let mut wait = Wait {
            ad: self,
            class,
            id,
            rx,
            settled: false,
        };
        let woken = tokio::time::timeout(timeout, &mut wait.rx).await;
        // Woken with room, it was taken for us; else, under the lock, room may have come
        // after the timer fired (then it is ours), or we leave the queue.
        let granted = match woken {
            Ok(Ok(())) => {
                wait.settled = true;
                true
            }
            _ => wait.settle(),
        };
        if granted {
            self.gauges.per_class[class][0].inc();
            return Ok(self.permit(class));
        }
        let why = match woken {
            Ok(Err(_)) => Refusal::QueueFull,
            _ => Refusal::Timeout,
        };
        let mut g = self.inner.lock();
        Err(self.refused(&mut g, class, why))
    }

    fn refused(&self, g: &mut Inner, class: usize, why: Refusal) -> Refusal {
        g.refused[class] += 1;
        self.publish(g);
        let i = match why {
            Refusal::Timeout => 1,
            Refusal::QueueFull => 2,
        };
        self.gauges.per_class[class][i].inc();
        why
    }

    fn permit(self: &Arc<Self>, class: usize) -> Permit {
        Permit {
            ad: self.clone(),
            class,
            sampled: false,
        }
    }

    /// Give back room taken by `class`, and hand it to whoever waits.
    fn release(&self, class: usize) {
        let mut g = self.inner.lock();
        g.in_flight = g.in_flight.saturating_sub(1);
        g.by_class[class] = g.by_class[class].saturating_sub(1);
        g.grant(&self.cfg.classes);
        self.publish(&g);
    }

    /// Add one latency sample (`ok`: answered below 500) to the window, and end the window
    /// at `now` when it is due.
    fn record(&self, latency: Duration, ok: bool, now: Instant) {
        let mut g = self.inner.lock();
        if g.window.samples.len() < WINDOW_SAMPLES {
            g.window
                .samples
                .push(u32::try_from(latency.as_micros()).unwrap_or(u32::MAX));
        }
        if !ok {
            g.window.failed += 1;
        }
        let before = g.ctl.limit();
        self.roll(&mut g, now);
        if g.ctl.limit() > before {
            g.grant(&self.cfg.classes);
        }
        self.publish(&g);
    }

    /// End the window when it is long enough and has enough samples; revise the limit.
    fn roll(&self, g: &mut Inner, now: Instant) {
        let age = now.saturating_duration_since(g.window.started);
        if age < self.cfg.window {
            return;
        }
        if g.window.samples.len() < self.cfg.min_samples as usize {
            // Too quiet to say anything: start again rather than judge on stale samples.
            if age >= self.cfg.window * 50 {
                g.window = Window::new(now);
            }
            return;
        }
        let mut w = std::mem::replace(&mut g.window, Window::new(now));
        let n = w.samples.len();
        let median = f64::from(*w.samples.select_nth_unstable(n / 2).1);
        let at = (n * usize::from(self.cfg.percentile) / 100).min(n - 1);
        let tail = f64::from(*w.samples.select_nth_unstable(at).1);
        let summary = WindowSummary {
            median_us: median,
            tail_us: tail,
            samples: w.samples.len() as u32,
            failed: w.failed,
            peak_in_flight: w.peak,
            pressure: w.pressure,
        };
        let before = g.ctl.limit();
        let after = g.ctl.update(&summary);
        g.last_median_us = Some(summary.median_us);
        g.window.peak = g.in_flight;
        let sec = unix_now();
        match g.history.back_mut() {
            Some(last) if last.0 == sec => {
                last.1 = after;
                last.2 = last.2.max(w.peak);
            }
            _ => {
                if g.history.len() == HISTORY {
                    g.history.pop_front();
                }
                g.history.push_back((sec, after, w.peak));
            }
        }
        if after != before {
            tracing::debug!(before, after, median_us = summary.median_us, baseline_us = ?g.ctl.baseline_us(), "adaptive limit revised");
        }
        self.gauges.latency.set(summary.median_us / 1e6);
        self.gauges.baseline.set(g.ctl.baseline_us().unwrap_or(0.0) / 1e6);
    }

    fn publish(&self, g: &Inner) {
        self.gauges.limit.set(i64::from(g.ctl.limit()));
        self.gauges.in_flight.set(i64::from(g.in_flight));
        self.gauges.queued.set(g.queued as i64);
    }

    /// What `/status` and the dashboard show.
    pub fn status(&self) -> serde_json::Value {
        let g = self.inner.lock();
        let limit = g.ctl.limit();
        let ms = |us: Option<f64>| us.map(|u| (u / 10.0).round() / 100.0);
        serde_json::json!({
            "algorithm": self.cfg.tuning.algorithm.as_str(),
            "limit": limit,
            "min": self.cfg.tuning.min,
            "max": self.cfg.tuning.max,
            "in_flight": g.in_flight,
            "queued": g.queued,
            "latency_ms": ms(g.last_median_us),
            "baseline_ms": ms(g.ctl.baseline_us()),
            "target_ms": ms(g.ctl.target_us()),
            "classes": self.cfg.classes.iter().enumerate().map(|(k, c)| serde_json::json!({
                "name": &*c.name,
                "guaranteed_slots": Inner::guaranteed(&self.cfg.classes, k, limit),
                "in_flight": g.by_class[k],
                "waiting": g.waiting[k].len(),
                "admitted": g.admitted[k],
                "refused": g.refused[k],
            })).collect::<Vec<_>>(),
            "history": g.history.iter().map(|(t, l, f)| [*t, u64::from(*l), u64::from(*f)]).collect::<Vec<_>>(),
        })
    }
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A queued request's place; leaving it (the request is granted, refused or dropped) takes
/// it out of the queue, and room granted to a request that is no longer there is passed on.
struct Wait<'a> {
    ad: &'a Arc<Adaptive>,
    class: usize,
    id: u64,
    rx: oneshot::Receiver<()>,
    settled: bool,
}

impl Wait<'_> {
    /// Under the lock: was room granted? If not, leave the queue.
    fn settle(&mut self) -> bool {
        self.settled = true;
        let mut g = self.ad.inner.lock();
        let granted = self.rx.try_recv().is_ok();
        if !granted {
            let q = &mut g.waiting[self.class];
            if let Some(at) = q.iter().position(|w| w.id == self.id) {
                q.remove(at);
                g.queued -= 1;
            }
            self.ad.publish(&g);
        }
        granted
    }
}

impl Drop for Wait<'_> {
    fn drop(&mut self) {
        if !self.settled && self.settle() {
            self.ad.release(self.class);
        }
    }
}

/// Room for one request in flight, given back when it is dropped: by the proxy when the
/// upstream's response body ends (or the exchange fails), so that a streamed answer counts for
/// as long as the upstream sends it.
#[derive(Debug)]
pub struct Permit {
    ad: Arc<Adaptive>,
    class: usize,
    sampled: bool,
}

impl Permit {
    /// Record the request's latency to the upstream's response head, and whether it got an
    /// answer below 500 (once; later calls are ignored). A request whose failure was its
    /// client's or this gateway's (a body cut off, a connection cap) is not recorded at all.
    pub fn sample(&mut self, latency: Duration, ok: bool) {
        if !std::mem::replace(&mut self.sampled, true) {
            self.ad.record(latency, ok, Instant::now());
        }
    }

    /// The class it was taken for.
    pub fn class(&self) -> usize {
        self.class
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.ad.release(self.class);
    }
}
