//! The regions family (`crate::regions`): each peer region's replication lag, failed sync
//! rounds and bytes moved. Empty while `store.region` is not set. Labels name regions only.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PeerLabels {
    peer: String,
}

/// The family's handles.
#[derive(Clone, Default)]
pub struct RegionMetrics {
    lag: Family<PeerLabels, Gauge<f64, AtomicU64>>,
    errors: Family<PeerLabels, Counter>,
    bytes: Family<PeerLabels, Counter>,
}

/// One peer's handles, resolved once by the sync task.
#[derive(Clone)]
pub struct PeerMetrics {
    /// Seconds since this region last read the peer's spend, plus that read's duration.
    pub lag: Gauge<f64, AtomicU64>,
    /// Sync rounds with the peer that failed.
    pub errors: Counter,
    /// Bytes sent to and read from the peer's store.
    pub bytes: Counter,
}

impl RegionMetrics {
    /// Register the family in `r`.
    pub(super) fn register(r: &mut Registry) -> Self {
        let m = RegionMetrics::default();
        r.register(
            "region_sync_lag_seconds",
            "How old what this gateway knows of a peer region's spend is (since its last good read, plus that read's duration)",
            m.lag.clone(),
        );
        r.register(
            "region_sync_errors",
            "Sync rounds with a peer region that failed (unreachable, timed out)",
            m.errors.clone(),
        );
        r.register(
            "region_sync_bytes",
            "Bytes of replication traffic to and from a peer region's store",
            m.bytes.clone(),
        );
        m
    }

    /// The handles of peer region `name`.
    pub fn peer(&self, name: &str) -> PeerMetrics {
        let l = PeerLabels { peer: name.to_string() };
        PeerMetrics {
            lag: self.lag.get_or_create(&l).clone(),
            errors: self.errors.get_or_create(&l).clone(),
            bytes: self.bytes.get_or_create(&l).clone(),
        }
    }
}
