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

use super::report::reports;
use super::{unix_us, Mode, PeerConfig, PeerCount, Regions, Touch};

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

/// Where a store is: a peer's, or this region's own (for `budget` reports). Its `Debug` shows
/// no URL and no password.
#[derive(Clone)]
pub struct StoreAt {
    /// A Redis Cluster.
    pub cluster: bool,
    /// Its URLs.
    pub urls: Vec<String>,
    /// `AUTH` password.
    pub password: Option<crate::yaml::Secret>,
    /// PEM roots for `rediss://` (else the system's).
    pub ca_pem: Option<Vec<u8>>,
}

impl std::fmt::Debug for StoreAt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreAt")
            .field("cluster", &self.cluster)
            .field("urls", &self.urls.len())
            .finish_non_exhaustive()
    }
}

impl From<&PeerConfig> for StoreAt {
    fn from(p: &PeerConfig) -> Self {
        StoreAt {
            cluster: p.cluster,
            urls: p.urls.clone(),
            password: p.password.clone(),
            ca_pem: None,
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
            b = b.password(p.expose());
        }
        if let Some(ca) = at
            .ca_pem
            .clone()
            .filter(|_| at.urls.iter().all(|u| u.starts_with("rediss://")))
        {
            b = b.certs(redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(ca),
            });
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
    let tls = matches!(info.addr(), redis::ConnectionAddr::TcpTls { .. });
    let client = match at.ca_pem.clone() {
        Some(ca) if tls => redis::Client::build_with_tls(
            info,
            redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(ca),
            },
        )?,
        _ => redis::Client::open(info)?,
    };
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
pub(super) struct Link {
    at: StoreAt,
    conn: Option<Conn>,
}

impl Link {
    pub(super) async fn run(&mut self, p: &Pipeline, timeout: Duration) -> redis::RedisResult<Vec<Value>> {
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
pub(super) fn int(v: &Value) -> Option<u64> {
    match v {
        Value::Int(i) => u64::try_from(*i).ok(),
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        Value::SimpleString(s) => s.parse().ok(),
        _ => None,
    }
}

/// Text of a bulk or simple string reply.
fn text(v: &Value) -> Option<&[u8]> {
    match v {
        Value::BulkString(b) => Some(b),
        Value::SimpleString(s) => Some(s.as_bytes()),
        _ => None,
    }
}

/// `HMGET key i c q` as a count of the window of `window_us` that holds `now_us`. A counter of
/// this shape (`f:<window>`) counts in its own window. A counter of another shape (an override
/// or a reload gave the key another window or algorithm) counts all its units in the current
/// window: the key expires when its own window ends, so they are units spent recently, and
/// counting them never under-counts. No counter: nothing.
pub(super) fn count_of(v: &Value, window_us: u64, now_us: u64) -> PeerCount {
    let Value::Array(a) = v else {
        return PeerCount::default();
    };
    let shape = format!("f:{window_us}");
    match (a.first().and_then(int), a.get(1).and_then(int), a.get(2).and_then(text)) {
        (Some(index), Some(units), Some(q)) if q == shape.as_bytes() => PeerCount { index, units },
        (_, Some(units), _) => PeerCount {
            index: now_us / window_us.max(1),
            units,
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
