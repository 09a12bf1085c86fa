//! Balancing and ejection. Power of two choices: two random targets that are in,
//! the one with fewer requests in flight (counted until the response body ends) wins. `eject_after`
//! consecutive failures (connect errors, TLS failures, exchanges that failed, 5xx answers) take a
//! target out for `eject_for`, doubled each time it fails again after coming back, at most
//! [`MAX_EJECT_DOUBLINGS`] times; a success resets both. The last target in is never ejected. The
//! health check, when configured, takes a target out at its first failed check and brings it back
//! at its first passing one.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use http::{Request, Uri};

use super::{Target, Upstream, UpstreamError};

/// An ejection period is doubled at most this many times (`eject_for` × 32).
pub const MAX_EJECT_DOUBLINGS: u32 = 5;

impl Upstream {
    /// Milliseconds since the upstream's `epoch`, at least 1 (0 in `out_until_ms` means in).
    pub(super) fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis())
            .unwrap_or(u64::MAX)
            .max(1)
    }

    /// Is target `t` in (not ejected) at `now`?
    pub(super) fn is_in(&self, t: &Target, now: u64) -> bool {
        t.out_until_ms.load(Ordering::Relaxed) <= now
    }

    /// A random number (splitmix64 over a shared Weyl sequence; no lock).
    pub(super) fn random(&self) -> u64 {
        let mut z = self
            .rng
            .fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed)
            .wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Power of two choices among the targets that are in, other than `avoid`; when none is,
    /// `avoid` itself (or, with nothing in at all, any target: one always stays in).
    pub(super) fn pick(&self, avoid: Option<usize>) -> usize {
        let n = self.targets.len();
        if n == 1 {
            return 0;
        }
        let now = self.now_ms();
        let eligible = |i: usize| Some(i) != avoid && self.is_in(&self.targets[i], now);
        let count = (0..n).filter(|&i| eligible(i)).count();
        if count == 0 {
            return match avoid {
                Some(a) if self.is_in(&self.targets[a], now) => a,
                // Nothing is in (a race between two ejections): the one back soonest.
                _ => (0..n)
                    .min_by_key(|&i| self.targets[i].out_until_ms.load(Ordering::Relaxed))
                    .unwrap_or(0),
            };
        }
        let nth = |k: usize| (0..n).filter(|&i| eligible(i)).nth(k).unwrap_or(0);
        let r = self.random();
        let ka = (r % count as u64) as usize;
        let a = nth(ka);
        if count == 1 {
            return a;
        }
        // A second, different eligible target: `ka` plus 1..count, wrapped.
        let kb = (ka + 1 + ((r >> 32) % (count as u64 - 1)) as usize) % count;
        let b = nth(kb);
        let (fa, fb) = (
            self.targets[a].in_flight.load(Ordering::Relaxed),
            self.targets[b].in_flight.load(Ordering::Relaxed),
        );
        if fb < fa {
            b
        } else {
            a
        }
    }

    /// A success on target `i`: its failure count and its ejection doubling reset.
    pub(super) fn success(&self, i: usize) {
        let t = &self.targets[i];
        if t.fails.load(Ordering::Relaxed) != 0 {
            t.fails.store(0, Ordering::Relaxed);
        }
        if t.ejections.load(Ordering::Relaxed) != 0 && self.is_in(t, self.now_ms()) {
            t.ejections.store(0, Ordering::Relaxed);
            tracing::info!(target_url = %t.label, "upstream target answering again");
        }
    }

    /// A failure on target `i`; the `eject_after`-th in a row (or any, with `now`) ejects it.
    pub(super) fn failure(&self, i: usize, why: &dyn std::fmt::Display, now_eject: bool) {
        let t = &self.targets[i];
        let fails = t.fails.fetch_add(1, Ordering::Relaxed) + 1;
        if fails < self.eject_after && !now_eject {
            return;
        }
        let now = self.now_ms();
        if !self.is_in(t, now) {
            return;
        }
        // The last target in stays in.
        let others_in = self
            .targets
            .iter()
            .enumerate()
            .any(|(j, o)| j != i && self.is_in(o, now));
        if !others_in {
            return;
        }
        let doublings = t.ejections.fetch_add(1, Ordering::Relaxed).min(MAX_EJECT_DOUBLINGS);
        let period = self.eject_for.saturating_mul(1 << doublings);
        let until = now.saturating_add(u64::try_from(period.as_millis()).unwrap_or(u64::MAX));
        t.out_until_ms.store(until, Ordering::Relaxed);
        t.fails.store(0, Ordering::Relaxed);
        self.ejected.inc();
        t.counters.ejections.inc();
        let out_for_ms = u64::try_from(period.as_millis()).unwrap_or(u64::MAX);
        {
            let mut recent = self.recent.lock();
            if recent.len() == super::RECENT_EJECTIONS {
                recent.pop_front();
            }
            recent.push_back(super::Ejection {
                target: t.label.clone(),
                at_ms: unix_ms(),
                out_for_ms,
                why: why.to_string(),
            });
        }
        tracing::warn!(target_url = %t.label, failures = fails, out_for_ms = period.as_millis() as u64, error = %why, "upstream target ejected");
    }

    /// Ask every target `GET path` once; a failing one goes out at once (unless it is the last
    /// one in), a passing one that was out comes back.
    pub async fn health_check(self: &Arc<Self>, path: &http::uri::PathAndQuery, timeout: Duration) {
        let checks = (0..self.targets.len()).map(|i| {
            let up = self.clone();
            let uri = Uri::from(path.clone());
            async move {
                let t = &up.targets[i];
                let mut req = Request::new(crate::http::empty());
                *req.uri_mut() = uri;
                req.headers_mut().insert(http::header::HOST, t.host_header.clone());
                let result = tokio::time::timeout(timeout, async {
                    let (resp, flight) = up.attempt_quiet(i, req).await?;
                    let status = resp.status();
                    drop(flight);
                    Ok::<_, UpstreamError>(status)
                })
                .await;
                match result {
                    Ok(Ok(s)) if s.is_success() || s.is_redirection() => {
                        if !up.is_in(t, up.now_ms()) {
                            t.out_until_ms.store(0, Ordering::Relaxed);
                            t.fails.store(0, Ordering::Relaxed);
                            tracing::info!(target_url = %t.label, "upstream target passed its health check: back in");
                        }
                    }
                    Ok(Ok(s)) => up.failure(i, &format!("health check answered {s}"), true),
                    // At its connection cap the target is busy, not down: no verdict this round.
                    Ok(Err(e)) if e.is_saturated() => {}
                    Ok(Err(e)) => up.failure(i, &format!("health check failed: {e}"), true),
                    Err(_) => up.failure(i, &"health check timed out", true),
                }
            }
        });
        futures_util::future::join_all(checks).await;
    }
}

/// A seed for the balancer.
pub(super) fn seed() -> u64 {
    crate::http::request_id::random_u64()
}

/// The wall clock, Unix milliseconds (0 before 1970).
fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}
