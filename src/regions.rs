//! Regions: each region limits on its own store, and a `scope: global` rule also counts what
//! the other regions spent (ARCHITECTURE.md, "Regions").
//!
//! * **Counters.** A global rule's key names the region (`<rule>@<region>`), so every region's
//!   spend of a key and window is its own counter in its own store, written only there, exactly
//!   and atomically as any other limit. Nothing is merged, so nothing is counted twice, and a
//!   healed partition has nothing to reconcile.
//! * **Knowledge.** Every `sync_interval`, a background task ([`sync`]) reads the counters of the
//!   keys this gateway used from each peer region's store, batched. The request path reads only
//!   this memory: never a cross-region call.
//! * **`sync` mode.** A global limit `L` is checked in the local store as `L − R`, with `R` what
//!   the others had spent in this window when last read. The fleet over-admits by at most what
//!   the other regions spent since their last read: regions × rate × (interval + lag).
//! * **`budget` mode.** Each region checks `L × share`. The shares of window `w + 1` are computed
//!   by every region from the same inputs: each region's use of window `w`, published once
//!   (`SET NX`) in that region's store three quarters into `w` — by the region itself, or as 0 by
//!   a peer that found none, whichever comes first. A region that could not read every report
//!   (a partition) takes the floor share `floor / regions`, never more than it would have been
//!   given, so the shares in use never add up to more than the limit.
//!
//! Pure apart from [`sync`]: [`Regions::apply`] reads memory only.

pub mod config;
mod link;
mod report;
pub mod sync;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::num::NonZeroU64;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};
use smallvec::SmallVec;

pub use config::{rule_scopes, Mode, PeerConfig, RawRegions, RegionsConfig};

use crate::limiter::LimitCheck;

/// Shares are kept in millionths.
const PPM: u64 = 1_000_000;

/// What one peer region's store said of one key: the window it last counted and the units.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PeerCount {
    /// The window index of the count.
    pub index: u64,
    /// Units that region spent in that window.
    pub units: u64,
}

/// What this gateway knows of one global key.
#[derive(Debug, Clone)]
struct Known {
    /// Per peer, in `RegionsConfig::peers` order.
    peers: SmallVec<[PeerCount; 2]>,
    /// `budget`: this region's share (ppm) of two windows (index, ppm), agreed from every
    /// region's report; the current window's and the next one's once settled.
    shares: [Option<(u64, u64)>; 2],
    /// `budget`: the last window whose use this region published.
    published: Option<u64>,
    /// `budget`: the last window whose reports were settled (shares computed or given up on).
    reported: Option<u64>,
}

impl Default for Known {
    fn default() -> Self {
        Known {
            peers: SmallVec::new(),
            shares: [None, None],
            published: None,
            reported: None,
        }
    }
}

impl Known {
    /// The agreed share of window `index`, if settled.
    fn share_at(&self, index: u64) -> Option<u64> {
        self.shares.iter().flatten().find(|(i, _)| *i == index).map(|(_, p)| *p)
    }
}

/// Within this much of a window boundary, a `budget` region uses the smaller of the two
/// windows' shares: a gateway's clock and its store's (Redis `TIME`) may disagree by that much
/// about which window it is, and the store counts in its own.
pub const CLOCK_GUARD_US: u64 = 100_000;

/// A key used in this region: its window and the last window index it was used in.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Touch {
    pub window_us: u64,
    pub index: u64,
    /// When (unix µs) it was last used here.
    pub last_us: u64,
}

/// One peer region's sync health.
#[derive(Debug, Default)]
pub struct PeerStatus {
    /// Unix milliseconds of the last read that succeeded (0: never).
    pub last_ok_ms: AtomicU64,
    /// Microseconds the last successful round took (the lag it adds to what is known).
    pub round_us: AtomicU64,
    /// Rounds that failed.
    pub errors: AtomicU64,
    /// Bytes sent to and read from its store.
    pub bytes: AtomicU64,
    /// Unix µs when the last successful read began (0: never).
    pub last_start_us: AtomicU64,
    /// The longest a gateway decided on one read's numbers: from the start of a successful
    /// read to the end of the next one, in µs (the lag the `sync` bound uses).
    pub max_staleness_us: AtomicU64,
}

/// The result of [`Regions::apply`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// The check's limit now is what this region may spend of it.
    Check,
    /// Nothing is left for this region in this window: deny, for `reset_us`.
    Exhausted {
        /// Until the window ends.
        reset_us: u64,
    },
}

/// Regional state: what is known of the peers' spend of global keys, and the keys this gateway
/// used. Shared by the request path ([`Regions::apply`]) and the sync task.
#[derive(Debug)]
pub struct Regions {
    config: RegionsConfig,
    status: Vec<PeerStatus>,
    known: RwLock<HashMap<Arc<str>, Known>>,
    touched: Mutex<HashMap<Arc<str>, Touch>>,
}

impl Regions {
    /// Regions for `config`, knowing nothing yet.
    pub fn new(config: RegionsConfig) -> Self {
        let status = config.peers.iter().map(|_| PeerStatus::default()).collect();
        Regions {
            config,
            status,
            known: RwLock::new(HashMap::new()),
            touched: Mutex::new(HashMap::new()),
        }
    }

    /// The validated config.
    pub fn config(&self) -> &RegionsConfig {
        &self.config
    }

    /// Each peer's sync health, in `config().peers` order.
    pub fn status(&self) -> &[PeerStatus] {
        &self.status
    }

    /// Regions in all, this one included.
    fn count(&self) -> u64 {
        self.config.peers.len() as u64 + 1
    }

    /// The share (ppm) a region has when it cannot know better: `floor / regions`.
    pub fn floor_ppm(&self) -> u64 {
        self.config.floor_ppm()
    }

    /// Make `check`, of a `scope: global` rule, what this region may spend at `now_us`: in
    /// `sync` mode the limit less what the peers last reported for this window, in `budget`
    /// mode this region's share of it. Records the key for the next sync. Memory only.
    pub fn apply(&self, check: &mut LimitCheck, now_us: u64) -> Applied {
        let limit = check.quota.limit.get();
        let window_us = check.quota.window_us.get();
        let index = now_us / window_us;
        let reset_us = (index + 1).saturating_mul(window_us).saturating_sub(now_us).max(1);
        {
            let mut t = self.touched.lock();
            match t.get_mut(&check.key.0) {
                Some(e) => {
                    e.index = index;
                    e.window_us = window_us;
                    e.last_us = now_us;
                }
                None => {
                    t.insert(
                        check.key.0.clone(),
                        Touch {
                            window_us,
                            index,
                            last_us: now_us,
                        },
                    );
                }
            }
        }
        let allowed = {
            let known = self.known.read();
            let k = known.get(&check.key.0);
            match self.config.mode {
                Mode::Sync => {
                    let remote: u64 = k
                        .map(|k| k.peers.iter().filter(|p| p.index == index).map(|p| p.units).sum())
                        .unwrap_or(0);
                    limit.saturating_sub(remote)
                }
                Mode::Budget => {
                    let floor = self.floor_ppm();
                    let at = |i: u64| k.and_then(|k| k.share_at(i)).unwrap_or(floor);
                    let into = now_us % window_us;
                    let guard = CLOCK_GUARD_US.min(window_us / 4);
                    let mut ppm = at(index);
                    if into < guard {
                        ppm = ppm.min(at(index.saturating_sub(1)));
                    }
                    if window_us - into <= guard {
                        ppm = ppm.min(at(index + 1));
                    }
                    share_of(limit, ppm)
                }
            }
        };
        match NonZeroU64::new(allowed) {
            Some(l) => {
                check.quota.limit = l;
                Applied::Check
            }
            None => Applied::Exhausted { reset_us },
        }
    }

    /// What is known of each peer's spend of `key` in window `index` (0 when not known for it),
    /// in `config().peers` order, for `/keys`.
    pub fn peer_units(&self, key: &str, index: u64) -> Vec<(Arc<str>, u64)> {
        let known = self.known.read();
        let k = known.get(key);
        self.config
            .peers
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let units = k
                    .and_then(|k| k.peers.get(i))
                    .filter(|c| c.index == index)
                    .map_or(0, |c| c.units);
                (p.name.clone(), units)
            })
            .collect()
    }

    /// The keys used in the current or the previous window at `now_us`; older ones are
    /// forgotten (with what was known of them).
    pub(crate) fn live_keys(&self, now_us: u64) -> Vec<(Arc<str>, Touch)> {
        let mut dropped = Vec::new();
        let live: Vec<(Arc<str>, Touch)> = {
            let mut t = self.touched.lock();
            t.retain(|k, v| {
                let keep = v.index + 1 >= now_us / v.window_us;
                if !keep {
                    dropped.push(k.clone());
                }
                keep
            });
            t.iter().map(|(k, v)| (k.clone(), *v)).collect()
        };
        if !dropped.is_empty() {
            let mut known = self.known.write();
            for k in dropped {
                known.remove(&k);
            }
        }
        live
    }

    /// Record what peer `peer` said of `key`.
    pub(crate) fn learn(&self, key: &Arc<str>, peer: usize, count: PeerCount) {
        let n = self.config.peers.len();
        let mut known = self.known.write();
        let k = known.entry(key.clone()).or_default();
        if k.peers.len() < n {
            k.peers.resize(n, PeerCount::default());
        }
        if let Some(p) = k.peers.get_mut(peer) {
            *p = count;
        }
    }

    /// `budget`: true when this region's use of window `index` of `key` is still to be
    /// published; marks it published.
    pub(crate) fn to_publish(&self, key: &Arc<str>, index: u64) -> bool {
        let mut known = self.known.write();
        let k = known.entry(key.clone()).or_default();
        if k.published.is_some_and(|p| p >= index) {
            return false;
        }
        k.published = Some(index);
        true
    }

    /// `budget`: true when window `index`'s reports of `key` are still to be settled.
    pub(crate) fn unreported(&self, key: &str, index: u64) -> bool {
        self.known
            .read()
            .get(key)
            .is_none_or(|k| k.reported.is_none_or(|r| r < index))
    }

    /// `budget`: window `index`'s reports of `key` are settled; with every region's use of it
    /// (this region's first), this region's share of window `index + 1` follows. `None`: a
    /// report could not be read, and the floor share applies.
    pub(crate) fn settle(&self, key: &Arc<str>, index: u64, uses: Option<&[u64]>) {
        let share = uses.map(|u| (index + 1, share_ppm(u, self.floor_ppm(), self.count())));
        let mut known = self.known.write();
        let k = known.entry(key.clone()).or_default();
        k.reported = Some(index);
        if let Some(share) = share {
            // Keep the current window's share; replace the older one.
            let older = match k.shares {
                [None, _] => 0,
                [_, None] => 1,
                [Some((a, _)), Some((b, _))] => usize::from(b < a),
            };
            k.shares[older] = Some(share);
        }
    }

    /// `budget`: this region's share (ppm) of `key` in window `index`, as [`Regions::apply`]
    /// uses it.
    pub fn share_ppm_of(&self, key: &str, index: u64) -> u64 {
        self.known
            .read()
            .get(key)
            .and_then(|k| k.share_at(index))
            .unwrap_or_else(|| self.floor_ppm())
    }

    /// The key `key` (this region's counter) has in region `peer`'s store.
    pub fn peer_key(&self, key: &str, peer: &str) -> Option<String> {
        let own = format!("@{}:", self.config.name);
        let at = key.rfind(&own)?;
        Some(format!("{}@{}:{}", &key[..at], peer, &key[at + own.len()..]))
    }
}

/// `limit × ppm / 10⁶`, rounded down.
pub fn share_of(limit: u64, ppm: u64) -> u64 {
    u64::try_from(u128::from(limit) * u128::from(ppm) / u128::from(PPM)).unwrap_or(limit)
}

/// This region's share (ppm) from every region's use of the last window, this region's first:
/// the floor plus the rest of the limit in proportion to use; equal shares when nobody used
/// it. Every region computes the same shares from the same uses, and they add up to at most
/// 10⁶ (each is rounded down).
pub fn share_ppm(uses: &[u64], floor_ppm: u64, regions: u64) -> u64 {
    let total: u128 = uses.iter().map(|&u| u128::from(u)).sum();
    let own = uses.first().copied().unwrap_or(0);
    if total == 0 {
        return PPM / regions.max(1);
    }
    let rest = u128::from(PPM.saturating_sub(floor_ppm * regions));
    let extra = rest * u128::from(own) / total;
    floor_ppm + u64::try_from(extra).unwrap_or(0)
}

/// Where the report of window `index` of `key` (a region's counter) lives in that region's store.
pub fn report_key(key: &str, index: u64) -> String {
    format!("{key}#{index}")
}

/// The peers' total in `known` (a test helper's view).
#[cfg(test)]
impl Regions {
    fn known_of(&self, key: &str) -> Option<Known> {
        self.known.read().get(key).cloned()
    }
}

/// Unix microseconds now.
pub(crate) fn unix_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

impl Regions {
    /// `/status`'s `region`: this region, the mode, and each peer's last sync (unix ms, `null`
    /// when never), its age, the last round's duration, failed rounds and bytes moved.
    pub fn status_json(&self) -> serde_json::Value {
        let now_ms = unix_us() / 1000;
        let peers: Vec<serde_json::Value> = self
            .config
            .peers
            .iter()
            .zip(&self.status)
            .map(|(p, s)| {
                let last = s.last_ok_ms.load(Ordering::Relaxed);
                serde_json::json!({
                    "name": &*p.name,
                    "last_sync_ms": (last > 0).then_some(last),
                    "sync_age_ms": (last > 0).then(|| now_ms.saturating_sub(last)),
                    "round_ms": s.round_us.load(Ordering::Relaxed) as f64 / 1000.0,
                    "errors": s.errors.load(Ordering::Relaxed),
                    "bytes": s.bytes.load(Ordering::Relaxed),
                    "max_staleness_ms": s.max_staleness_us.load(Ordering::Relaxed) as f64 / 1000.0,
                })
            })
            .collect();
        serde_json::json!({
            "name": &*self.config.name,
            "mode": self.config.mode.as_str(),
            "sync_interval_ms": self.config.sync_interval.as_millis() as u64,
            "budget_floor": self.config.budget_floor,
            "peers": peers,
        })
    }
}
