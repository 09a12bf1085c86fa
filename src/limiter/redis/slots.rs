//! Shards: which Redis node owns a key's slot, and one circuit breaker per node.
//!
//! # Why per shard
//! A cluster fails one master at a time. If one frozen shard opened a gateway-wide breaker,
//! every rule — including those whose keys live on healthy masters — would fall back to its
//! failure policy, and a denial from a healthy slot would be thrown away with the failed
//! call. So each master has its own [`Breaker`]; a request's limits on a failed shard follow
//! their failure policy and the rest are decided by their own, healthy, shards.
//!
//! # How
//! [`Topology`] maps each of the 16384 slots to a shard (a master address) and is read from
//! `CLUSTER SLOTS` at connect, after every connection rebuild, and while a breaker is open (a
//! failover moves slots to another address, whose breaker starts closed). It sits in an
//! `ArcSwap`: a request loads it once, clones the one `Arc<Shard>` it needs and drops the guard
//! before any `.await`. A shard keeps its breaker across refreshes as long as its address stays.
//! Standalone Redis is one shard that owns every slot.

use std::sync::Arc;
use std::time::Instant;

use redis::Value;

use super::protocol::{peeked, Mode};
use super::{batch, RedisStore};
use crate::limiter::{Checked, LimitCheck, Outcome, StoreError};

use crate::limiter::StoreKey;

use crate::limiter::breaker::Breaker;

/// Slots in a Redis Cluster.
pub(crate) const SLOT_COUNT: usize = 16384;

/// The Redis Cluster slot of `key`: CRC16 (XMODEM) of its hash tag, modulo 16384.
pub(crate) fn slot_of(key: &str) -> u16 {
    let b = key.as_bytes();
    let tagged = b.iter().position(|&c| c == b'{').and_then(|open| {
        let rest = &b[open + 1..];
        rest.iter()
            .position(|&c| c == b'}')
            .filter(|&close| close > 0)
            .map(|close| &rest[..close])
    });
    crc16(tagged.unwrap_or(b)) % SLOT_COUNT as u16
}

/// CRC16/XMODEM (polynomial 0x1021), the checksum Redis Cluster hashes keys with.
fn crc16(data: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &byte in data {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// One master: its address, its breaker and its clock's offset from ours.
#[derive(Debug)]
pub(crate) struct Shard {
    /// `host:port` of the master (or of the standalone server), for logs and probes.
    pub(crate) addr: String,
    /// Opens after `threshold` consecutive failed calls to this shard; closed by a probe.
    pub(crate) breaker: Breaker,
    /// A slot this shard owns, to route its probe (`None` for standalone).
    pub(crate) probe_slot: Option<u16>,
    /// Its `TIME` minus this process's monotonic clock, for check deadlines.
    pub(crate) offset: Offset,
}

/// Drift the offset estimate may follow downward, per µs elapsed since it was last set: 100
/// ppm (clocks disciplined by NTP drift apart far slower; a step of the server's clock back
/// only makes deadlines looser until the estimate has caught up).
const DRIFT_PER_US: i64 = 10_000;

/// How far a shard's Redis `TIME` reads ahead of this process's monotonic clock (µs since the
/// store's epoch), learned from replies: every reply carries the instant its script ran, which
/// came before the reply arrived, so `redis_at − arrival` is a **lower bound** of the offset.
/// The estimate is the tightest (largest) bound seen, and may follow lower bounds down by at
/// most [`DRIFT_PER_US`] of the time since it was set (slow drift, never a noisy sample).
///
/// A deadline `send + offset + timeout` in Redis time is therefore never later than the local
/// deadline: a script that runs before it ran while its caller was still waiting. A
/// `parking_lot` mutex held for a few integer operations.
#[derive(Debug, Default)]
pub(crate) struct Offset {
    /// `(estimate, local instant it was set)`, `None` until the first reply.
    state: parking_lot::Mutex<Option<(i64, u64)>>,
}

impl Offset {
    /// Learn from a reply whose script ran at `redis_us` (Redis `TIME`) and that arrived at
    /// `local_us` (this process's monotonic clock).
    pub(crate) fn learn(&self, redis_us: u64, local_us: u64) {
        let bound = i64::try_from(redis_us).unwrap_or(i64::MAX) - i64::try_from(local_us).unwrap_or(i64::MAX);
        let mut s = self.state.lock();
        *s = Some(match *s {
            Some((est, _)) if bound >= est => (bound, local_us),
            Some((est, at)) => {
                let drift = i64::try_from(local_us.saturating_sub(at)).unwrap_or(i64::MAX) / DRIFT_PER_US;
                (
                    bound.max(est.saturating_sub(drift)),
                    if drift > 0 { local_us } else { at },
                )
            }
            None => (bound, local_us),
        });
    }

    /// The Redis instant that corresponds to `local_us` on this process's monotonic clock (a
    /// lower bound), or `None` before anything was learned.
    pub(crate) fn redis_at(&self, local_us: u64) -> Option<u64> {
        let (est, _) = (*self.state.lock())?;
        let at = i64::try_from(local_us).unwrap_or(i64::MAX).saturating_add(est);
        u64::try_from(at).ok().filter(|&t| t > 0)
    }

    /// True once an offset was learned.
    pub(crate) fn known(&self) -> bool {
        self.state.lock().is_some()
    }
}

/// Which shard owns each slot.
#[derive(Debug)]
pub(crate) struct Topology {
    /// Every known shard (masters that own slots; one for standalone).
    pub(crate) shards: Vec<Arc<Shard>>,
    /// Shard index per slot; empty for standalone (everything is shard 0).
    owner: Vec<u16>,
}

impl Topology {
    /// Standalone Redis, or a cluster whose layout is not known yet: one shard for everything.
    pub(crate) fn single(addr: String, threshold: u32) -> Self {
        Topology {
            shards: vec![Arc::new(Shard {
                addr,
                breaker: Breaker::new(threshold),
                probe_slot: None,
                offset: Offset::default(),
            })],
            owner: Vec::new(),
        }
    }

    /// The shard that owns `slot`.
    pub(crate) fn shard_for(&self, slot: u16) -> &Arc<Shard> {
        let i = self.owner.get(usize::from(slot)).copied().unwrap_or(0);
        // Every index in `owner` was pushed to `shards` when the table was built.
        &self.shards[usize::from(i).min(self.shards.len() - 1)]
    }

    /// A topology from a `CLUSTER SLOTS` reply, keeping the breakers of shards whose address
    /// `self` already knows. `None` when the reply has no slot range.
    pub(crate) fn refreshed(&self, reply: &Value, threshold: u32) -> Option<Topology> {
        let ranges = parse_cluster_slots(reply);
        if ranges.is_empty() {
            return None;
        }
        let mut shards: Vec<Arc<Shard>> = Vec::new();
        let mut owner = vec![0u16; SLOT_COUNT];
        for (start, end, addr) in ranges {
            let i = match shards.iter().position(|s| s.addr == addr) {
                Some(i) => i,
                None => {
                    let kept = self.shards.iter().find(|s| s.addr == addr && s.probe_slot.is_some());
                    shards.push(match kept {
                        Some(s) => Arc::clone(s),
                        None => Arc::new(Shard {
                            addr,
                            breaker: Breaker::new(threshold),
                            probe_slot: Some(start),
                            offset: Offset::default(),
                        }),
                    });
                    shards.len() - 1
                }
            };
            let i = u16::try_from(i).unwrap_or(0);
            for slot in start..=end.min(SLOT_COUNT as u16 - 1) {
                owner[usize::from(slot)] = i;
            }
        }
        Some(Topology { shards, owner })
    }

    /// Shards whose breaker is open.
    pub(crate) fn open_shards(&self) -> impl Iterator<Item = &Arc<Shard>> {
        self.shards.iter().filter(|s| s.breaker.is_open())
    }
}

/// `(first slot, last slot, "host:port" of the master)` per range of a `CLUSTER SLOTS` reply.
fn parse_cluster_slots(reply: &Value) -> Vec<(u16, u16, String)> {
    let Value::Array(ranges) = reply else {
        return Vec::new();
    };
    let int = |v: &Value| match v {
        Value::Int(i) => u16::try_from(*i).ok(),
        _ => None,
    };
    let text = |v: &Value| match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    };
    ranges
        .iter()
        .filter_map(|r| {
            let Value::Array(items) = r else { return None };
            let start = int(items.first()?)?;
            let end = int(items.get(1)?)?;
            let Value::Array(master) = items.get(2)? else {
                return None;
            };
            let host = text(master.first()?)?;
            let port = int(master.get(1)?)?;
            Some((start, end, format!("{host}:{port}")))
        })
        .collect()
}

/// Group check indexes by hash tag (one group per Redis Cluster slot), in first-seen order.
/// Requests carry a handful of limits, so a linear scan beats hashing.
pub(crate) fn group_by_tag<'a>(keys: impl Iterator<Item = &'a StoreKey>) -> Vec<Vec<usize>> {
    let mut tags: Vec<&str> = Vec::new();
    let mut groups: Vec<Vec<usize>> = Vec::new();
    for (i, k) in keys.enumerate() {
        let tag = k.hash_tag();
        match tags.iter().position(|t| *t == tag) {
            Some(g) => groups[g].push(i),
            None => {
                tags.push(tag);
                groups.push(vec![i]);
            }
        }
    }
    groups
}

/// True when every key shares the first key's hash tag (the common case: no grouping needed).
pub(crate) fn one_tag<'a>(mut keys: impl Iterator<Item = &'a StoreKey>) -> bool {
    match keys.next() {
        Some(first) => {
            let tag = first.hash_tag();
            keys.all(|k| k.hash_tag() == tag)
        }
        None => true,
    }
}

/// Several slots: all or nothing with refunds (see the module docs of `redis`).
impl RedisStore {
    /// [`Store::check`] at an explicit `now` (microseconds since the epoch) instead of Redis
    /// `TIME` when `now` is `Some` — differential tests drive Redis and the memory store with
    /// the same clock. `None` is the production path.
    ///
    /// Each slot's call is bounded by `store.timeout` and gated by its shard's breaker, so a
    /// failed shard fails only its own checks (in [`Checked::failed`]); a denial from a healthy
    /// slot stands, and the healthy slots that spent for a denied request are refunded.
    pub async fn check_at<C: AsRef<LimitCheck> + Sync>(&self, checks: &[C], now: Option<u64>) -> Checked {
        if checks.is_empty() {
            return Checked::default();
        }
        let start = Instant::now();
        if one_tag(checks.iter().map(|c| &c.as_ref().key)) {
            // Fast path: one slot, one script call, no grouping.
            let owned = checks.iter().map(|c| c.as_ref().clone()).collect();
            return match self.check_group(now, owned).await {
                Ok((_, outcomes)) => Checked {
                    outcomes: outcomes.into(),
                    failed: Vec::new(),
                },
                Err(e) => Checked::all_failed(checks.len(), e),
            };
        }
        // One owned copy per check, made where its slot's call needs it (the batch task outlives
        // this future).
        let checks: Vec<&LimitCheck> = checks.iter().map(AsRef::as_ref).collect();
        let groups = group_by_tag(checks.iter().map(|c| &c.key));
        let calls = groups
            .iter()
            .map(|g| self.check_group(now, g.iter().map(|&i| checks[i].clone()).collect()));
        let results = futures_util::future::join_all(calls).await;
        let mut out = Checked {
            outcomes: smallvec::smallvec![Outcome::default(); checks.len()],
            failed: Vec::new(),
        };
        let mut answered: Vec<(&[usize], u64)> = Vec::with_capacity(groups.len());
        for (g, r) in groups.iter().zip(results) {
            match r {
                Ok((group_now, outs)) => {
                    answered.push((g, group_now));
                    for (&i, o) in g.iter().zip(outs) {
                        out.outcomes[i] = o;
                    }
                }
                Err(e) => out.failed.extend(g.iter().map(|&i| (i, e.clone()))),
            }
        }
        let outcomes = &out.outcomes;
        let denied = |i: usize| !outcomes[i].allowed && !checks[i].shadow;
        if !answered.iter().any(|(g, _)| g.iter().any(|&i| denied(i))) {
            return out;
        }
        // Blocked by a healthy slot: give back what the groups that spent (no non-shadow denial
        // inside) took, in the window their script counted it in.
        let mut refunds: Vec<(u64, Vec<LimitCheck>)> = Vec::new();
        for (g, group_now) in &answered {
            if g.iter().any(|&i| denied(i)) {
                continue; // this group's script wrote nothing
            }
            let spent: Vec<LimitCheck> = g
                .iter()
                .filter(|&&i| outcomes[i].allowed && checks[i].cost > 0)
                .map(|&i| checks[i].clone())
                .collect();
            if !spent.is_empty() {
                refunds.push((*group_now, spent));
            }
        }
        if !refunds.is_empty() {
            self.spawn_refunds(refunds, start).await;
        }
        out
    }

    /// One slot's checks: refused at once while its shard's breaker is open, else one call
    /// bounded by `store.timeout` whose result counts towards that breaker.
    async fn check_group(&self, now: Option<u64>, checks: Vec<LimitCheck>) -> batch::Answer {
        let slot = checks.first().map_or(0, |c| slot_of(c.key.as_str()));
        let shard = Arc::clone(self.inner.topo.load().shard_for(slot));
        if shard.breaker.is_open() {
            return Err(StoreError::CircuitOpen);
        }
        let res = match tokio::time::timeout(self.inner.timeout, self.check_slot(now, slot, checks)).await {
            Ok(r) => r,
            Err(_) => Err(StoreError::Timeout),
        };
        match &res {
            Ok(_) => shard.breaker.success(),
            Err(e) => self.inner.shard_failure(&shard, e),
        }
        res
    }

    /// Check one request's limits on one slot: through the batch task in production
    /// (`now == None`), with a deadline `store.timeout` from now; as a call of its own, with
    /// no deadline, when a test drives time.
    async fn check_slot(&self, now: Option<u64>, slot: u16, checks: Vec<LimitCheck>) -> batch::Answer {
        match now {
            None => {
                let timeout = u64::try_from(self.inner.timeout.as_micros()).unwrap_or(u64::MAX);
                let deadline = self.inner.mono_us().saturating_add(timeout);
                self.batches.check(slot, checks, deadline).await
            }
            Some(_) => self
                .inner
                .check_batch(now, std::iter::once((checks.as_slice(), 0)))
                .await
                .map(|(now, outs)| (now, outs.into_iter().map(|(_, o)| o).collect())),
        }
    }

    /// Refund `(now, checks)` groups in a spawned task, so they complete even if the caller
    /// drops this future, and wait for them for at most half of the remaining deadline (a slow
    /// refund never turns a denial into a store failure).
    async fn spawn_refunds(&self, refunds: Vec<(u64, Vec<LimitCheck>)>, start: Instant) {
        let inner = Arc::clone(&self.inner);
        let task = async move {
            let calls = refunds
                .iter()
                .map(|(now, cs)| inner.call(Mode::Refund, Some(*now), cs.iter(), peeked));
            for r in futures_util::future::join_all(calls).await {
                if let Err(e) = r {
                    tracing::warn!(error = %e, "refund of a rejected cross-slot request failed");
                }
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(handle) => {
                let join = handle.spawn(task);
                let budget = self.inner.timeout.saturating_sub(start.elapsed()) / 2;
                let _ = tokio::time::timeout(budget, join).await;
            }
            Err(_) => task.await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_match_redis() {
        // Values from `CLUSTER KEYSLOT`.
        assert_eq!(slot_of("foo"), 12182);
        assert_eq!(slot_of("bar"), 5061);
        assert_eq!(slot_of("tl:{foo}:rule:0"), 12182);
        assert_eq!(slot_of("{}x"), slot_of("{}x"));
        assert_eq!(slot_of("123456789"), 0x31C3);
    }

    #[test]
    fn the_clock_offset_is_the_tightest_lower_bound_and_follows_drift_slowly() {
        let o = Offset::default();
        assert!(!o.known());
        assert_eq!(o.redis_at(1_000), None, "no deadline before anything was learned");
        // A reply that ran at Redis 5_000_000 and arrived at local 1_000: offset ≥ 4_999_000.
        o.learn(5_000_000, 1_000);
        assert_eq!(o.redis_at(2_000), Some(5_001_000));
        // A slower reply (arrived later for the same Redis instant) is a looser bound: ignored.
        o.learn(5_001_000, 3_000);
        assert_eq!(o.redis_at(2_000), Some(5_001_000));
        // A tighter one wins at once.
        o.learn(5_002_000, 2_500);
        assert_eq!(o.redis_at(2_000), Some(5_001_500));
        // Lower bounds pull the estimate down by at most 100 ppm of the time since it was set:
        // after 10 s, at most 1 ms, however low the sample.
        o.learn(0, 10_002_500);
        assert_eq!(o.redis_at(2_000), Some(5_000_500));
    }

    #[test]
    fn a_refresh_keeps_breakers_by_address() {
        let reply = |a: &str, b: &str| {
            let node = |h: &str| {
                let (host, port) = h.split_once(':').unwrap(); // allow-panic: test
                Value::Array(vec![
                    Value::BulkString(host.as_bytes().to_vec()),
                    Value::Int(port.parse().unwrap()), // allow-panic: test
                ])
            };
            Value::Array(vec![
                Value::Array(vec![Value::Int(0), Value::Int(8191), node(a)]),
                Value::Array(vec![Value::Int(8192), Value::Int(16383), node(b)]),
            ])
        };
        let t0 = Topology::single("seed".into(), 1);
        let t1 = t0.refreshed(&reply("h:1", "h:2"), 1).unwrap(); // allow-panic: test
        assert_eq!(t1.shard_for(0).addr, "h:1");
        assert_eq!(t1.shard_for(16383).addr, "h:2");
        assert!(t1.shard_for(9000).breaker.failure(), "threshold 1 opens");
        assert_eq!(t1.open_shards().count(), 1);
        // A failover moves the second range to h:3: its breaker starts closed; h:1 keeps its own.
        let t2 = t1.refreshed(&reply("h:1", "h:3"), 1).unwrap(); // allow-panic: test
        assert_eq!(t2.open_shards().count(), 0);
        assert!(Arc::ptr_eq(t1.shard_for(0), t2.shard_for(0)));
    }
}
