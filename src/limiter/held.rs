//! Concurrency slots held by running requests, and the settlement of a request's real cost:
//! the parts of [`Limiter`] that act after a request was admitted.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::{LimitCheck, Limiter, Source, Store};

/// The count of upstream exchanges and settlements still under way after their request ended
/// (see [`Limiter::pending`]).
#[derive(Debug, Default)]
pub(crate) struct Pending {
    n: AtomicUsize,
    idle: tokio::sync::Notify,
}

/// Counts one exchange or settlement under way until dropped.
#[derive(Debug)]
pub struct PendingGuard(Arc<Pending>);

impl Drop for PendingGuard {
    fn drop(&mut self) {
        if self.0.n.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

impl Limiter {
    /// Count an upstream exchange or settlement under way (a held request whose client may
    /// leave, a cost still to settle) until the guard is dropped: shutdown waits for it
    /// ([`Limiter::settled`]), so what a client owes is charged before the process exits.
    pub fn pending(&self) -> PendingGuard {
        self.pending.n.fetch_add(1, Ordering::AcqRel);
        PendingGuard(self.pending.clone())
    }

    /// Wait until nothing counted by [`Limiter::pending`] is under way, for at most `within`;
    /// false when some still was.
    pub async fn settled(&self, within: Duration) -> bool {
        let wait = async {
            loop {
                let idle = self.pending.idle.notified();
                if self.pending.n.load(Ordering::Acquire) == 0 {
                    return;
                }
                idle.await;
            }
        };
        tokio::time::timeout(within, wait).await.is_ok()
    }

    /// Count `spent` (what a request reserved) as reserved and not yet settled, or, with
    /// `add` false, no longer.
    pub fn track_reserved(&self, spent: &[(LimitCheck, u64, Source)], add: bool) {
        let mut r = self.reserved.lock();
        for (c, _, _) in spent {
            if add {
                *r.entry(c.key.clone()).or_insert(0) += c.cost;
            } else if let Some(v) = r.get_mut(&c.key) {
                *v = v.saturating_sub(c.cost);
                if *v == 0 {
                    r.remove(&c.key);
                }
            }
        }
    }

    /// Units this node's requests reserved at `key` and have not settled yet.
    pub fn reserved_at(&self, key: &super::StoreKey) -> u64 {
        self.reserved.lock().get(key).copied().unwrap_or(0)
    }

    /// A fresh holder id for one request's concurrency slots (never 0).
    pub fn holder(&self) -> u64 {
        match self.next_holder.fetch_add(1, std::sync::atomic::Ordering::Relaxed) {
            0 => self.next_holder.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
            h => h,
        }
    }

    /// Remember the slots a request took (the concurrency checks it spent), so
    /// [`Limiter::renew_held`] keeps them alive until [`Limiter::release`].
    pub fn hold(&self, holder: u64, slots: Vec<(LimitCheck, Source)>) {
        self.held.lock().insert(holder, slots);
    }

    /// The request `holder` ended: forget its slots and free them in the stores that hold them.
    pub async fn release(&self, holder: u64) {
        let slots = self.held.lock().remove(&holder);
        if let Some(slots) = slots {
            let spent: Vec<(LimitCheck, u64, Source)> = slots.into_iter().map(|(c, s)| (c, 0, s)).collect();
            self.refund(&spent).await;
        }
    }

    /// Renew every slot held by a running request (call every third of the slot time to
    /// live): in the primary store and, for slots taken during an outage, this node's.
    pub async fn renew_held(&self) {
        let (store, local): (Vec<LimitCheck>, Vec<LimitCheck>) = {
            let held = self.held.lock();
            let all = held.values().flatten();
            (
                all.clone()
                    .filter(|(_, s)| *s == Source::Store)
                    .map(|(c, _)| c.clone())
                    .collect(),
                all.filter(|(_, s)| *s == Source::Local)
                    .map(|(c, _)| c.clone())
                    .collect(),
            )
        };
        if !store.is_empty() {
            match tokio::time::timeout(self.timeout.saturating_mul(2), self.store.renew(&store)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, slots = store.len(), "renewing concurrency slots failed; they expire after store.concurrency_ttl unless a later renewal succeeds")
                }
                Err(_) => tracing::warn!(slots = store.len(), "renewing concurrency slots timed out"),
            }
        }
        if !local.is_empty() {
            self.local.renew_slots(&local);
        }
    }

    /// Settle what admitted checks reserved against the real cost `actual` (units per check):
    /// refund the difference when it is smaller, in the store and window that spent it; debit it
    /// when it is larger, in the store that spent it, at the instant it is known (see
    /// [`Store::debit`]: it lands in the check's window while that one lasts, else in the
    /// current one, and takes a key at most one quota below zero).
    pub async fn settle(&self, spent: &[(LimitCheck, u64, Source)], actual: u64) {
        let mut refunds = Vec::new();
        let (mut store, mut local): (Vec<LimitCheck>, Vec<LimitCheck>) = (Vec::new(), Vec::new());
        for (c, at, src) in spent {
            let mut d = c.clone();
            if actual < c.cost {
                d.cost = c.cost - actual;
                refunds.push((d, *at, *src));
            } else if actual > c.cost {
                d.cost = actual - c.cost;
                match src {
                    Source::Store => store.push(d),
                    Source::Local => local.push(d),
                    // Rules that settle never lease, and failure policies spent nothing.
                    _ => {}
                }
            }
        }
        if !refunds.is_empty() {
            self.refund(&refunds).await;
        }
        if !store.is_empty() {
            match tokio::time::timeout(self.timeout, self.store.debit(&store)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "debit of a reported cost failed; the request spent only its estimate")
                }
                Err(_) => tracing::warn!("debit of a reported cost timed out; it may not have landed"),
            }
        }
        if !local.is_empty() {
            self.local.debit_spent(&local);
        }
    }
}
