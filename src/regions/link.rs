//! A connection to one region's store (a peer's, or this region's own), opened on first use and
//! again after a failure, and the replies the sync task reads from it. Used only off the request
//! path.

use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster_async::ClusterConnection;
use redis::{IntoConnectionInfo, Pipeline, Value};

use super::{PeerConfig, PeerCount};

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
    /// A link to the store at `at`, not yet connected.
    pub(super) fn new(at: StoreAt) -> Self {
        Link { at, conn: None }
    }

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
pub(super) fn text(v: &Value) -> Option<&[u8]> {
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
