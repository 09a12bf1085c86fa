//! `budget` reports: each region publishes its use of a global key's window in its own store,
//! and every region settles the next window's shares from the same reports (ARCHITECTURE.md,
//! "Regions"). Called by the sync task each round; never on the request path.

use std::sync::Arc;
use std::time::Duration;

use super::link::{count_of, int, Link};
use super::{report_key, unix_us, Regions, Touch};

/// `budget`: half way into a key's window, publish this region's use of it (`SET NX` in this
/// region's store); three quarters in, settle the window: read the report that stands in every
/// region's store, closing a peer's that is missing as 0 (`SET 0 NX`, then `GET`), and compute
/// the next window's share from what every region then agrees on. `Some(false)`: a store could
/// not be reached (the floor share applies); `None`: nothing was due.
pub(super) async fn reports(
    regions: &Regions,
    own: &mut Link,
    peers: &mut [Link],
    keys: &[(Arc<str>, Touch)],
    timeout: Duration,
) -> Option<bool> {
    let now = unix_us();
    let into = |t: &Touch| now - (now / t.window_us) * t.window_us;
    let current = |t: &Touch| t.index == now / t.window_us;
    let publish: Vec<(Arc<str>, u64, u64)> = keys
        .iter()
        .filter(|(k, t)| current(t) && into(t) * 2 >= t.window_us && regions.to_publish(k, t.index))
        .map(|(k, t)| (k.clone(), t.index, t.window_us))
        .collect();
    let settle: Vec<(Arc<str>, u64, u64)> = keys
        .iter()
        .filter(|(k, t)| current(t) && into(t) * 4 >= t.window_us * 3 && regions.unreported(k, t.index))
        .map(|(k, t)| (k.clone(), t.index, t.window_us))
        .collect();
    if publish.is_empty() && settle.is_empty() {
        return None;
    }
    let ttl = |w: u64| (w / 1000).saturating_mul(3).max(1000);
    // This region's use of each window, from its own counter.
    let both: Vec<&(Arc<str>, u64, u64)> = publish.iter().chain(&settle).collect();
    let mut p = redis::pipe();
    for (k, _, _) in &both {
        p.cmd("HMGET").arg(&**k).arg("i").arg("c").arg("q");
    }
    let Ok(counts) = own.run(&p, timeout).await else {
        for (k, index, _) in &settle {
            regions.settle(k, *index, None);
        }
        return Some(false);
    };
    let used: Vec<u64> = both
        .iter()
        .zip(&counts)
        .map(|((_, index, w), c)| {
            let c = count_of(c, *w, now);
            if c.index == *index {
                c.units
            } else {
                0
            }
        })
        .collect();
    // Publish, and for the windows to settle also read back the report that stands.
    let mut p = redis::pipe();
    for (n, (k, index, w)) in both.iter().enumerate() {
        let rk = report_key(k, *index);
        p.cmd("SET").arg(&rk).arg(used[n]).arg("NX").arg("PX").arg(ttl(*w));
        if n >= publish.len() {
            p.cmd("GET").arg(&rk);
        }
    }
    let mut uses: Vec<Option<Vec<u64>>> = match own.run(&p, timeout).await {
        Ok(r) => {
            // Replies: one per SET, plus a GET after each SET of a window to settle.
            let gets = r.iter().skip(publish.len()).skip(1).step_by(2);
            gets.map(|v| int(v).map(|u| vec![u])).collect()
        }
        Err(_) => vec![None; settle.len()],
    };
    uses.resize(settle.len(), None);
    let mut ok = true;
    for (i, link) in peers.iter_mut().enumerate() {
        let Some(peer) = regions.config().peers.get(i) else {
            continue;
        };
        let mut p = redis::pipe();
        let mut asked = Vec::with_capacity(settle.len());
        for (n, (k, index, w)) in settle.iter().enumerate() {
            if let Some(pk) = regions.peer_key(k, &peer.name) {
                let rk = report_key(&pk, *index);
                p.cmd("SET").arg(&rk).arg(0).arg("NX").arg("PX").arg(ttl(*w));
                p.cmd("GET").arg(&rk);
                asked.push(n);
            }
        }
        match link.run(&p, timeout).await {
            Ok(r) => {
                for (n, v) in asked.into_iter().zip(r.iter().skip(1).step_by(2)) {
                    if let Some(Some(u)) = uses.get_mut(n) {
                        match int(v) {
                            Some(x) => u.push(x),
                            None => uses[n] = None,
                        }
                    }
                }
            }
            Err(_) => {
                ok = false;
                uses.iter_mut().for_each(|u| *u = None);
            }
        }
    }
    let regions_n = regions.config().peers.len() + 1;
    for ((k, index, _), u) in settle.iter().zip(uses) {
        let complete = u.filter(|u| u.len() == regions_n);
        regions.settle(k, *index, complete.as_deref());
    }
    Some(ok)
}
