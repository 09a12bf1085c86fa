//! What the store knows of the servers behind it: which master owns which slot (re-read from
//! `CLUSTER SLOTS`), and each shard's clock offset (learnt with `TIME`), the remote side of
//! every check deadline.

use std::sync::Arc;

use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};

use super::conn::{connect_timeout, Conn, Inner};
use super::{slots, RedisMode};

impl Inner {
    /// Re-read which master owns which slot (cluster only; a failed read keeps the old map),
    /// then learn the clock offset of every shard that has none yet.
    pub(super) async fn refresh_topology(&self) {
        if self.mode == RedisMode::Cluster {
            let Ok(mut conn) = self.conn() else { return };
            let cmd = redis::cmd("CLUSTER").arg("SLOTS").to_owned();
            if let Ok(Ok(reply)) = tokio::time::timeout(connect_timeout(self.timeout), conn.query(&cmd)).await {
                if let Some(t) = self.topo.load().refreshed(&reply, self.threshold) {
                    self.topo.store(Arc::new(t));
                }
            }
        }
        self.learn_offsets().await;
    }

    /// This process's monotonic clock, µs since the store was built: the local side of every
    /// shard's clock offset and of check deadlines.
    pub(super) fn mono_us(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_micros()).unwrap_or(u64::MAX)
    }

    /// One `TIME` to each shard whose clock offset is not known yet (at connect, after a
    /// rebuild or a failover), within the store deadline, so the first check sent to it
    /// already carries a deadline. Later replies keep the estimate tight.
    async fn learn_offsets(&self) {
        let Ok(conn) = self.conn() else { return };
        let shards: Vec<Arc<slots::Shard>> = self
            .topo
            .load()
            .shards
            .iter()
            .filter(|s| !s.offset.known())
            .cloned()
            .collect();
        let calls = shards.iter().map(|s| {
            let mut conn = conn.clone();
            async move {
                let cmd = redis::cmd("TIME");
                let reply = match (&mut conn, s.probe_slot) {
                    (Conn::Cluster(c), Some(slot)) => {
                        let node = SingleNodeRoutingInfo::SpecificNode(Route::new(slot, SlotAddr::Master));
                        c.route_command(cmd, RoutingInfo::SingleNode(node)).await
                    }
                    _ => conn.query(&cmd).await,
                };
                let arrived = self.mono_us();
                if let Ok(v) = reply {
                    if let Ok((secs, micros)) = redis::from_redis_value::<(u64, u64)>(v) {
                        s.offset
                            .learn(secs.saturating_mul(1_000_000).saturating_add(micros), arrived);
                    }
                }
            }
        });
        let _ = tokio::time::timeout(self.timeout, futures_util::future::join_all(calls)).await;
    }
}
