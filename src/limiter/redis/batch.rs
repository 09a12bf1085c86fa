//! Batching of limit checks, per Redis Cluster slot.
//!
//! # Why
//! Every `EVALSHA` costs Redis a fixed 10–25 µs of CPU (reading and parsing the command,
//! setting up the script, `TIME`, writing the reply) on top of the 2–3 µs its limits take, and
//! costs the gateway one client command (encoding, a channel hop, a reply to parse). Under
//! load many requests wait for the same slot at the same moment. Sent as ONE script call, which
//! evaluates them one after the other exactly as separate calls would have been (each request
//! all-or-nothing, a later one seeing what an earlier one spent), they cost that fixed part
//! once. No answer changes; only the number of round trips does.
//!
//! # How
//! One task per store owns the queues (no lock anywhere: requests reach it over a channel and
//! get their answer on a oneshot). For every slot at most **one** call is in flight:
//! * a slot with nothing in flight sends what is queued at once, so an idle gateway adds no
//!   delay and a lone request goes out as fast as before;
//! * while a slot's call is in flight, its new requests queue, and go out together, up to
//!   [`MAX_BATCH`] per call, the moment the call returns.
//!
//! Slots are independent: a frozen master stalls only the requests for its own slots, each of
//! which gives up at its own deadline (the caller's `store.timeout`). A request whose caller has
//! already given up (deadline passed, client gone) is dropped from the queue before its batch is
//! sent, so it never spends quota. Standalone Redis has no slots: everything shares one queue.
//!
//! # Deadlines
//! A request that timed out must never spend later, yet a call already written to a frozen
//! server runs when the server resumes. So every request carries its deadline (its caller's
//! `store.timeout`, on this process's monotonic clock), converted to the shard's Redis time with
//! the shard's clock offset (`slots::Offset`, learned from replies and at connect) when its batch
//! is sent; the script spends nothing for a request whose deadline has passed by its `TIME`,
//! and answers it "late", which the caller gets as [`StoreError::Timeout`] (the rule's failure
//! policy). The offset is a lower bound, so the Redis deadline is never later than the local
//! one. Refunds, debits and renewals carry none: they must land whenever they run.
//!
//! The deadline cannot cover a reply that is slow on its way back: the script ran in time and
//! spent, but the caller had given up (its timer fired, or its client went away) before the
//! reply arrived. Such a reply finds its oneshot closed, and what it spent is refunded at once,
//! before the slot's next call goes out, so the caller's next request sees it back.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use futures_util::stream::{FuturesUnordered, StreamExt};
use tokio::sync::{mpsc, oneshot};

use super::protocol::{peeked, Mode};
use super::{Inner, RedisMode};
use crate::limiter::{LimitCheck, Outcome, StoreError};

/// Most requests sent in one script call (the script runs them back to back, holding Redis for
/// a few µs each).
pub const MAX_BATCH: usize = 256;

/// What one request gets back: Redis' `now` and one outcome per limit.
pub(super) type Answer = Result<(u64, Vec<Outcome>), StoreError>;

/// A Redis Cluster slot number (0 for standalone Redis, which has one queue).
type Slot = u16;

/// One request's checks, waiting for their slot's next call.
pub(super) struct Pending {
    /// The request's limits, all on one slot (owned: the batch task outlives the caller).
    checks: Vec<LimitCheck>,
    /// Where the answer goes; closed once the caller gave up.
    reply: oneshot::Sender<Answer>,
    /// When the caller gives up, on the store's monotonic clock (`Inner::mono_us`).
    deadline: u64,
}

/// The request side of the batch task: submit one request's checks for one slot.
#[derive(Clone)]
pub(super) struct Batches {
    /// Standalone (one queue) or cluster (one queue per slot).
    mode: RedisMode,
    /// To the batch task. The task ends when the last sender is dropped.
    tx: mpsc::UnboundedSender<(Slot, Pending)>,
}

impl Batches {
    /// Start the batch task for the store `inner` on the current runtime.
    pub(super) fn spawn(inner: Arc<Inner>) -> Batches {
        let (tx, rx) = mpsc::unbounded_channel();
        let mode = inner.mode;
        tokio::spawn(run(inner, rx));
        Batches { mode, tx }
    }

    /// Queue `checks` (one request's limits, all on one slot), to be decided by `deadline` (on
    /// the store's monotonic clock, see the module docs), and wait for the answer.
    ///
    /// No timer of its own: the wait is bounded by the call in flight for the slot (its
    /// `store.timeout`) plus this request's own call, and the limiter's deadline around every
    /// check bounds it to `store.timeout` on the request path. A call that fails or times out
    /// is counted (towards a connection rebuild) by the batch task, once per call.
    pub(super) async fn check(&self, slot: u16, checks: Vec<LimitCheck>, deadline: u64) -> Answer {
        let slot = match self.mode {
            RedisMode::Cluster => slot,
            RedisMode::Single => 0,
        };
        let (reply, answer) = oneshot::channel();
        if self
            .tx
            .send((
                slot,
                Pending {
                    checks,
                    reply,
                    deadline,
                },
            ))
            .is_err()
        {
            return Err(StoreError::Redis("the Redis batch task has stopped".to_owned()));
        }
        answer
            .await
            .unwrap_or_else(|_| Err(StoreError::Redis("the Redis batch task dropped the request".to_owned())))
    }
}

/// A call in flight; resolves to its slot.
type InFlight = Pin<Box<dyn Future<Output = Slot> + Send>>;

/// The batch task's state. Owned by the task alone.
struct Queues {
    /// The store.
    inner: Arc<Inner>,
    /// Requests waiting, per slot. A slot's entry is removed once it is empty.
    waiting: HashMap<Slot, Vec<Pending>>,
    /// Slots with a call in flight.
    busy: HashSet<Slot>,
    /// The calls in flight.
    in_flight: FuturesUnordered<InFlight>,
}

impl Queues {
    /// Send what waits for `slot` unless the slot has a call in flight.
    fn launch(&mut self, slot: Slot) {
        if self.busy.contains(&slot) {
            return;
        }
        let Some(queue) = self.waiting.get_mut(&slot) else {
            return;
        };
        queue.retain(|p| !p.reply.is_closed());
        let batch: Vec<Pending> = if queue.len() > MAX_BATCH {
            queue.drain(..MAX_BATCH).collect()
        } else {
            self.waiting.remove(&slot).unwrap_or_default()
        };
        if batch.is_empty() {
            return;
        }
        self.busy.insert(slot);
        let inner = Arc::clone(&self.inner);
        self.in_flight.push(Box::pin(async move {
            send(&inner, slot, batch).await;
            slot
        }));
    }
}

/// The batch task: queue what arrives, send per slot, and hand out the answers.
async fn run(inner: Arc<Inner>, mut rx: mpsc::UnboundedReceiver<(Slot, Pending)>) {
    let mut q = Queues {
        inner,
        waiting: HashMap::new(),
        busy: HashSet::new(),
        in_flight: FuturesUnordered::new(),
    };
    let mut touched: Vec<Slot> = Vec::new();
    let mut open = true;
    while open || !q.in_flight.is_empty() {
        tokio::select! {
            biased;
            Some(slot) = q.in_flight.next(), if !q.in_flight.is_empty() => {
                q.busy.remove(&slot);
                q.launch(slot);
            }
            msg = rx.recv(), if open => match msg {
                Some(first) => {
                    // Take everything that is already queued, then send per slot.
                    let mut next = Some(first);
                    while let Some((slot, p)) = next {
                        q.waiting.entry(slot).or_default().push(p);
                        touched.push(slot); // duplicates are harmless: `launch` is a no-op once busy
                        next = rx.try_recv().ok();
                    }
                    for slot in touched.drain(..) {
                        q.launch(slot);
                    }
                }
                None => open = false,
            },
        }
    }
}

/// One script call for `batch` (on `slot`), each request with its deadline in the shard's
/// Redis time; every request gets its own slice of the reply, a timeout when it came too late,
/// or the error. The reply teaches the shard's clock offset.
async fn send(inner: &Arc<Inner>, slot: Slot, batch: Vec<Pending>) {
    inner.batch_calls.fetch_add(1, Ordering::Relaxed);
    inner.batch_requests.fetch_add(batch.len() as u64, Ordering::Relaxed);
    let shard = Arc::clone(inner.topo.load().shard_for(slot));
    let deadlines: Vec<u64> = batch
        .iter()
        .map(|p| shard.offset.redis_at(p.deadline).unwrap_or(0))
        .collect();
    let requests = batch.iter().zip(&deadlines).map(|(p, &d)| (p.checks.as_slice(), d));
    match inner.check_batch(None, requests).await {
        Ok((now, outcomes)) => {
            shard.offset.learn(now, inner.mono_us());
            let mut outcomes = outcomes.into_iter();
            let mut abandoned = Vec::new();
            for p in batch {
                let mine: Vec<(bool, Outcome)> = outcomes.by_ref().take(p.checks.len()).collect();
                let answer = if mine.iter().any(|(late, _)| *late) {
                    Err(StoreError::Timeout)
                } else {
                    Ok((now, mine.into_iter().map(|(_, o)| o).collect()))
                };
                if let Err(Ok((_, outcomes))) = p.reply.send(answer) {
                    abandoned.extend(spent_by(p.checks, &outcomes));
                }
            }
            // Before the slot's next call goes out (rare, and one round trip): a later request
            // of the same caller then sees the units back.
            if !abandoned.is_empty() {
                give_back(inner, now, abandoned).await;
            }
        }
        Err(e) => {
            for p in batch {
                let _ = p.reply.send(Err(e.clone()));
            }
        }
    }
}

/// What an admitted request spent, as refunds: each admitted limit's cost plus the units it
/// leased, at the instant it was spent; nothing when a non-shadow limit denied (then nothing
/// was spent). A slot's refund releases it.
fn spent_by(checks: Vec<LimitCheck>, outcomes: &[Outcome]) -> Vec<LimitCheck> {
    let denied = checks.iter().zip(outcomes).any(|(c, o)| !o.allowed && !c.shadow);
    if denied {
        return Vec::new();
    }
    checks
        .into_iter()
        .zip(outcomes)
        .filter(|(_, o)| o.allowed)
        .map(|(mut c, o)| {
            c.cost = c.cost.saturating_add(o.leased);
            c.lease = None;
            c
        })
        .collect()
}

/// Refund what requests spent after their callers had given up (the reply came back after the
/// caller's own deadline, or the client went away while it was in flight): the caller answered
/// from its failure policy or not at all, so those units must not stay spent. All on one slot,
/// one call at the instant the script ran.
async fn give_back(inner: &Inner, now: u64, spent: Vec<LimitCheck>) {
    tracing::debug!(
        limits = spent.len(),
        "refunding a check whose caller gave up before its reply"
    );
    if let Err(e) = inner.call(Mode::Refund, Some(now), spent.iter(), peeked).await {
        tracing::warn!(error = %e, "refund of a check its caller gave up on failed; the units stay spent until their window passes");
    }
}
