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

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::{IntoConnectionInfo, Pipeline, Value};

use super::{report_key, unix_us, Mode, PeerConfig, PeerCount, Regions, Touch};

/// A connection to one region's store.
#[derive(Clone)]
enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl Conn {
    async fn run(&mut self, p: &Pipeline) -> redis::RedisResult<Vec<Value>> {
        match self {
            Conn::Single(c) => p.query_async(c).await,
            // A cluster pipeline must stay on one node: the commands go one by one, together.
            Conn::Cluster(c) => {
                let calls = p.cmd_iter().map(|cmd| {
                    let mut c = c.clone();
                    async move { cmd.query_async::<Value>(&mut c).await }
                });
                futures_util::future::join_all(calls).await.into_iter().collect()
            }
        }
    }
}

/// Where a store is: a peer's, or this region's own (for `budget` reports).
#[derive(Debug, Clone)]
pub struct StoreAt {
    /// A Redis Cluster.
    pub cluster: bool,
    /// Its URLs.
    pub urls: Vec<String>,
    /// `AUTH` password (its `Debug` never shows it).
    pub password: Option<crate::yaml::Secret>,
}

impl From<&PeerConfig> for StoreAt {
    fn from(p: &PeerConfig) -> Self {
        StoreAt {
            cluster: p.cluster,
            urls: p.urls.clone(),
            password: p.password.clone(),
        }
    }
}

async fn open(at: &StoreAt, timeout: Duration) -> redis::RedisResult<Conn> {
    let fail = |m: &'static str| redis::RedisError::from((redis::ErrorKind::Io, m));
    if at.cluster {
        let mut b = redis::cluster::ClusterClientBuilder::new(at.urls.iter().map(String::as_str))
            .connection_timeout(timeout)
            .response_timeout(timeout)
            .retries(1);
        if let Some(p) = &at.password {
            b = b.password(p.expose().to_string());
        }
        let c = b.build()?;
        let conn = tokio::time::timeout(timeout * 3, c.get_async_connection())
            .await
            .map_err(|_| fail("connect timed out"))??;
        return Ok(Conn::Cluster(conn));
    }
    let url = at.urls.first().ok_or_else(|| fail("no URL"))?;
    let mut info = url.as_str().into_connection_info()?;
    if let Some(p) = &at.password {
        let s = info.redis_settings().clone().set_password(p.expose());
        info = info.set_redis_settings(s);
    }
    let client = redis::Client::open(info)?;
    let config = ConnectionManagerConfig::new()
        .set_response_timeout(Some(timeout))
        .set_connection_timeout(Some(timeout))
        .set_number_of_retries(0);
    let cm = tokio::time::timeout(timeout * 3, ConnectionManager::new_with_config(client, config))
        .await
        .map_err(|_| fail("connect timed out"))??;
    Ok(Conn::Single(cm))
}

/// A store's connection, opened on first use and again after a failure.
struct Link {
    at: StoreAt,
    conn: Option<Conn>,
}

impl Link {
    async fn run(&mut self, p: &Pipeline, timeout: Duration) -> redis::RedisResult<Vec<Value>> {
        let mut conn = match self.conn.clone() {
            Some(c) => c,
            None => {
                let c = open(&self.at, timeout).await?;
                self.conn = Some(c.clone());
                c
            }
        };
        let r = tokio::time::timeout(timeout, conn.run(p))
            .await
            .unwrap_or_else(|_| Err(redis::RedisError::from((redis::ErrorKind::Io, "timed out"))));
        if r.is_err() {
            self.conn = None;
        }
        r
    }
}

/// An integer reply (bulk text or integer); `None` for nil or anything else.
fn int(v: &Value) -> Option<u64> {
    match v {
        Value::Int(i) => u64::try_from(*i).ok(),
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        Value::SimpleString(s) => s.parse().ok(),
        _ => None,
    }
}

/// `HMGET key i c` as a count: the window index and the units.
fn count_of(v: &Value) -> PeerCount {
    match v {
        Value::Array(a) if a.len() == 2 => match (int(&a[0]), int(&a[1])) {
            (Some(index), Some(units)) => PeerCount { index, units },
            _ => PeerCount::default(),
        },
        _ => PeerCount::default(),
    }
}

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
pub async fn run(
    regions: Arc<Regions>,
    own: StoreAt,
    metrics: crate::metrics::RegionMetrics,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let config = regions.config().clone();
    let handles: Vec<crate::metrics::PeerMetrics> = config.peers.iter().map(|p| metrics.peer(&p.name)).collect();
    let timeout = config.sync_interval.max(Duration::from_millis(200)) * 2;
    let mut peers: Vec<Link> = config
        .peers
        .iter()
        .map(|p| Link {
            at: p.into(),
            conn: None,
        })
        .collect();
    let mut own = Link { at: own, conn: None };
    let mut tick = tokio::time::interval(config.sync_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut warned = vec![false; peers.len()];
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
            let r = if recent.is_empty() {
                // Nothing to read: still prove the peer reachable, for the lag and /status.
                let mut p = redis::pipe();
                p.cmd("PING");
                link.run(&p, timeout).await.map(|_| 14)
            } else {
                read_peer(&regions, i, link, &recent, timeout).await
            };
            count(&handles, i, &r);
            note(&regions, i, r, started, &mut warned);
        }
        if config.mode == Mode::Budget {
            reports(&regions, &mut own, &mut peers, &keys, timeout).await;
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
            s.bytes.fetch_add(bytes, Ordering::Relaxed);
            s.round_us
                .store(u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX), Ordering::Relaxed);
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
                tracing::warn!(peer = name, error = %e.kind().to_string(), "region peer unreachable: limiting on what was last known of it");
                warned[i] = true;
            }
        }
    }
}

/// Read peer `i`'s counters of `keys`; the bytes moved.
async fn read_peer(
    regions: &Regions,
    i: usize,
    link: &mut Link,
    keys: &[(Arc<str>, Touch)],
    timeout: Duration,
) -> redis::RedisResult<u64> {
    let Some(peer) = regions.config().peers.get(i) else {
        return Ok(0);
    };
    let mut p = redis::pipe();
    let mut sent = 0u64;
    let mut asked = Vec::with_capacity(keys.len());
    for (k, _) in keys {
        if let Some(pk) = regions.peer_key(k, &peer.name) {
            sent += 30 + pk.len() as u64;
            p.cmd("HMGET").arg(pk).arg("i").arg("c");
            asked.push(k);
        }
    }
    let replies = link.run(&p, timeout).await?;
    let mut got = 0u64;
    for (k, v) in asked.into_iter().zip(&replies) {
        got += reply_bytes(v);
        regions.learn(k, i, count_of(v));
    }
    Ok(sent + got)
}

/// `budget`: for each key three quarters or more into its window whose reports are not
/// settled, publish this region's use (`SET NX`), close each peer's (`SET 0 NX`, the peer's own
/// report if it came first), and settle the next window's share from what all agree on.
async fn reports(regions: &Regions, own: &mut Link, peers: &mut [Link], keys: &[(Arc<str>, Touch)], timeout: Duration) {
    let now = unix_us();
    let due: Vec<(Arc<str>, u64, u64)> = keys
        .iter()
        .filter_map(|(k, t)| {
            let index = now / t.window_us;
            let into = now - index * t.window_us;
            (t.index == index && into * 4 >= t.window_us * 3 && regions.unreported(k, index))
                .then(|| (k.clone(), index, t.window_us))
        })
        .collect();
    if due.is_empty() {
        return;
    }
    // This region's use of each due window, from its own counter.
    let mut p = redis::pipe();
    for (k, _, _) in &due {
        p.cmd("HMGET").arg(&**k).arg("i").arg("c");
    }
    let Ok(counts) = own.run(&p, timeout).await else {
        for (k, index, _) in &due {
            regions.settle(k, *index, None);
        }
        return;
    };
    // Publish them; each reply is the report that stands.
    let ttl = |w: u64| (w / 1000).saturating_mul(3).max(1000);
    let mut p = redis::pipe();
    for ((k, index, w), c) in due.iter().zip(&counts) {
        let c = count_of(c);
        let used = if c.index == *index { c.units } else { 0 };
        p.cmd("SET")
            .arg(report_key(k, *index))
            .arg(used)
            .arg("NX")
            .arg("GET")
            .arg("PX")
            .arg(ttl(*w));
    }
    let mine = own.run(&p, timeout).await;
    let mut uses: Vec<Option<Vec<u64>>> = match &mine {
        Ok(r) => due
            .iter()
            .zip(r)
            .zip(&counts)
            .map(|(((_, index, _), stood), c)| {
                // nil: ours was set; else the value that stood.
                let c = count_of(c);
                let used = if c.index == *index { c.units } else { 0 };
                Some(vec![int(stood).unwrap_or(used)])
            })
            .collect(),
        Err(_) => vec![None; due.len()],
    };
    for (i, link) in peers.iter_mut().enumerate() {
        let Some(peer) = regions.config().peers.get(i) else {
            continue;
        };
        let mut p = redis::pipe();
        let mut asked = Vec::with_capacity(due.len());
        for (n, (k, index, w)) in due.iter().enumerate() {
            if let Some(pk) = regions.peer_key(k, &peer.name) {
                p.cmd("SET")
                    .arg(report_key(&pk, *index))
                    .arg(0)
                    .arg("NX")
                    .arg("GET")
                    .arg("PX")
                    .arg(ttl(*w));
                asked.push(n);
            }
        }
        match link.run(&p, timeout).await {
            Ok(r) => {
                for (n, v) in asked.into_iter().zip(&r) {
                    if let Some(Some(u)) = uses.get_mut(n) {
                        u.push(int(v).unwrap_or(0));
                    }
                }
            }
            Err(_) => uses.iter_mut().for_each(|u| *u = None),
        }
    }
    let regions_n = regions.config().peers.len() + 1;
    for ((k, index, _), u) in due.iter().zip(uses) {
        let complete = u.filter(|u| u.len() == regions_n);
        regions.settle(k, *index, complete.as_deref());
    }
}
