//! `store.leases`: validation of the lease settings.

use std::num::{NonZeroU32, NonZeroU64};
use std::path::Path;

use serde_saphyr::Spanned;

use super::raw::RawLeases;
use super::{duration, ConfigError, StoreKind};
use crate::limiter::lease::LeaseConfig;

/// The leases a store takes: `None` on the memory store (one node has nothing to lease) or with
/// `enabled: false`. On by default for Redis and Redis Cluster.
pub fn leases(
    file: &Path,
    raw: &Option<Spanned<RawLeases>>,
    kind: StoreKind,
) -> Result<Option<LeaseConfig>, ConfigError> {
    let mut cfg = LeaseConfig::default();
    let Some(raw) = raw else {
        return Ok((kind != StoreKind::Memory).then_some(cfg));
    };
    let r = &raw.value;
    if let Some(m) = &r.min_rate {
        let interval = crate::rules::parse_rate(&m.value)
            .map_err(|e| ConfigError::at(file, &m.referenced, format!("store.leases.min_rate: {e}")))?;
        let per_s = 1_000_000 / interval.get();
        cfg.min_rate = u32::try_from(per_s).ok().and_then(NonZeroU32::new).ok_or_else(|| {
            ConfigError::at(
                file,
                &m.referenced,
                format!(
                    "store.leases.min_rate: {:?} must be between 1/s and 4294967295/s",
                    m.value
                ),
            )
        })?;
    }
    if let Some(t) = &r.ttl {
        let d = duration(file, t)?;
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        if !(10_000..=10_000_000).contains(&us) {
            return Err(ConfigError::at(
                file,
                &t.referenced,
                format!("store.leases.ttl: {:?} must be between 10ms and 10s", t.value),
            ));
        }
        cfg.ttl_us = NonZeroU64::new(us).unwrap_or(cfg.ttl_us);
    }
    if let Some(s) = &r.max_share {
        let ppm = (s.value * 1_000_000.0).round();
        if !(s.value > 0.0 && s.value <= 0.5 && ppm >= 1.0) {
            return Err(ConfigError::at(
                file,
                &s.referenced,
                format!(
                    "store.leases.max_share: {} must be more than 0 and at most 0.5",
                    s.value
                ),
            ));
        }
        cfg.max_share_ppm = NonZeroU32::new(ppm as u32).unwrap_or(cfg.max_share_ppm);
    }
    Ok((r.enabled.unwrap_or(true) && kind != StoreKind::Memory).then_some(cfg))
}
