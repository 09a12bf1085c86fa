//! The sync task: every `sync_interval`, off the request path, read each peer region's
//! counters of the global keys this gateway used, and (`budget`) settle the window's reports.
//!
//! One pipelined `HMGET` per key and peer, in one batch per peer. A peer that cannot be
//! reached keeps what was last known of it (`sync`) or gives this region the floor share
//! (`budget`); its connection is rebuilt on the next round. Never holds a lock across an
//! `.await`.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::Value;

pub use super::link::StoreAt;
use super::link::{count_of, text, Link};
use super::report::reports;
use super::{unix_us, Mode, Regions, Touch};

/// Bytes a reply took on the wire, near enough (for the replication metric).
fn reply_bytes(v: &Value) -> u64 {
    match v {
        Value::Array(a) => 4 + a.iter().map(reply_bytes).sum::<u64>(),
        Value::BulkString(b) => 6 + b.len() as u64,
        _ => 5,
    }
}

/// The sync task of `regions` until `stop` says so. `own` is this region's store (read for
/// `budget` reports).
/// `marker` is the key (`<key_prefix>:region`) where every region's store holds that region's
/// name: written to this region's store every round, and read from each peer's.
pub async fn run(
    regions: Arc<Regions>,
    own: StoreAt,
    marker: String,
    metrics: crate::metrics::RegionMetrics,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let config = regions.config().clone();
    let handles: Vec<crate::metrics::PeerMetrics> = config.peers.iter().map(|p| metrics.peer(&p.name)).collect();
    let timeout = config.sync_interval.max(Duration::from_millis(200)) * 2;
    let mut peers: Vec<Link> = config.peers.iter().map(|p| Link::new(p.into())).collect();
    let mut own = Link::new(own);
    let mut tick = tokio::time::interval(config.sync_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut warned = vec![false; peers.len()];
    let mut reports_ok = true;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        if *stop.borrow() {
            return;
        }
        let now = unix_us();
        lag(&regions, &handles, now);
        // This region names its own store (a peer reading it checks the name).
        let mut p = redis::pipe();
        p.cmd("SET").arg(&marker).arg(&*config.name);
        let _ = own.run(&p, timeout).await;
        let keys = regions.live_keys(now);
        // Only keys used here since two rounds ago are read: a key used again after a pause
        // decides on older numbers for at most one round, at its own rate (docs/regions.md).
        let recent_us = u64::try_from(config.sync_interval.as_micros())
            .unwrap_or(u64::MAX)
            .saturating_mul(2);
        let recent: Vec<(Arc<str>, Touch)> = keys
            .iter()
            .filter(|(_, t)| t.last_us + recent_us >= now)
            .cloned()
            .collect();
        for (i, link) in peers.iter_mut().enumerate() {
            let started = Instant::now();
            // With nothing to read, the marker alone still proves the peer reachable (and
            // rightly named), for the lag and /status.
            let r = if recent.is_empty() {
                read_peer(&regions, i, link, &[], (timeout, &marker)).await
            } else {
                read_peer(&regions, i, link, &recent, (timeout, &marker)).await
            };
            count(&handles, i, &r);
            note(&regions, i, r, started, &mut warned);
        }
        if config.mode == Mode::Budget {
            let ok = reports(&regions, &mut own, &mut peers, &keys, timeout).await;
            // A round with nothing to publish or settle says nothing either way.
            if let Some(ok) = ok.filter(|ok| *ok != reports_ok) {
                if ok {
                    tracing::info!("region budget reports settle again");
                } else {
                    tracing::warn!("region budget reports could not be settled: this region runs on its floor share");
                }
                reports_ok = ok;
            }
        }
    }
}

/// Each peer's lag at `now_us`: the age of the last good read plus its duration (from start
/// until the first read, the time since start).
fn lag(regions: &Regions, handles: &[crate::metrics::PeerMetrics], now_us: u64) {
    for (s, h) in regions.status().iter().zip(handles) {
        let last = s.last_ok_ms.load(Ordering::Relaxed);
        if last == 0 {
            continue;
        }
        let age_us = now_us.saturating_sub(last * 1000) + s.round_us.load(Ordering::Relaxed);
        h.lag.set(age_us as f64 / 1e6);
    }
}

/// Count round `r` of peer `i` in the metrics.
fn count(handles: &[crate::metrics::PeerMetrics], i: usize, r: &redis::RedisResult<u64>) {
    let Some(h) = handles.get(i) else {
        return;
    };
    match r {
        Ok(b) => {
            h.bytes.inc_by(*b);
        }
        Err(_) => {
            h.errors.inc();
        }
    }
}

/// Record round `r` (bytes moved) of peer `i`, begun at `started`.
fn note(regions: &Regions, i: usize, r: redis::RedisResult<u64>, started: Instant, warned: &mut [bool]) {
    let Some(s) = regions.status().get(i) else {
        return;
    };
    let name = regions.config().peers.get(i).map_or("", |p| &*p.name);
    match r {
        Ok(bytes) => {
            let start_us = unix_us().saturating_sub(u64::try_from(started.elapsed().as_micros()).unwrap_or(0));
            let prev = s.last_start_us.swap(start_us, Ordering::Relaxed);
            if prev > 0 {
                s.max_staleness_us
                    .fetch_max(unix_us().saturating_sub(prev), Ordering::Relaxed);
            }
            s.bytes.fetch_add(bytes, Ordering::Relaxed);
            s.round_us.store(
                u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX),
                Ordering::Relaxed,
            );
            s.last_ok_ms.store(unix_us() / 1000, Ordering::Relaxed);
            if warned[i] {
                tracing::info!(peer = name, "region peer reachable again");
                warned[i] = false;
            }
        }
        Err(e) => {
            s.errors.fetch_add(1, Ordering::Relaxed);
            if !warned[i] {
                // Once per outage: the error kind, never the URL (it may hold a password).
                tracing::warn!(peer = name, error = ?e.kind(), "region peer unreachable: limiting on what was last known of it");
                warned[i] = true;
            }
        }
    }
}

/// Keys read from a peer in one pipeline (each its own round trip and deadline).
const READ_CHUNK: usize = 2000;

/// Read peer `i`'s counters of `keys`; the bytes moved. The first pipeline also reads the name
/// the peer's store was given by its own region (`marker`): a store that names another region
/// (this one, or a name spelled otherwise) is not read at all, and the round fails.
async fn read_peer(
    regions: &Regions,
    i: usize,
    link: &mut Link,
    keys: &[(Arc<str>, Touch)],
    (timeout, marker): (Duration, &str),
) -> redis::RedisResult<u64> {
    let Some(peer) = regions.config().peers.get(i) else {
        return Ok(0);
    };
    let now = unix_us();
    let mut moved = 0u64;
    let chunks: Vec<&[(Arc<str>, Touch)]> = if keys.is_empty() {
        vec![keys]
    } else {
        keys.chunks(READ_CHUNK).collect()
    };
    for (n, chunk) in chunks.into_iter().enumerate() {
        let mut p = redis::pipe();
        if n == 0 {
            p.cmd("GET").arg(marker);
        }
        let mut asked = Vec::with_capacity(chunk.len());
        for (k, t) in chunk {
            if let Some(pk) = regions.peer_key(k, &peer.name) {
                moved += 34 + pk.len() as u64;
                p.cmd("HMGET").arg(pk).arg("i").arg("c").arg("q");
                asked.push((k, t.window_us));
            }
        }
        let replies = link.run(&p, timeout).await?;
        let mut replies = replies.iter();
        if n == 0 {
            let named = replies
                .next()
                .and_then(text)
                .map(|t| String::from_utf8_lossy(t).into_owned());
            if let Some(named) = named.filter(|m| **m != *peer.name) {
                tracing::error!(
                    peer = &*peer.name,
                    store_names = named.as_str(),
                    "region peer misconfigured: its store belongs to another region; not read"
                );
                return Err(redis::RedisError::from((
                    redis::ErrorKind::Io,
                    "the peer's store names another region",
                )));
            }
        }
        for ((k, w), v) in asked.into_iter().zip(replies) {
            moved += reply_bytes(v);
            regions.learn(k, i, count_of(v, w, now));
        }
    }
    Ok(moved)
}
