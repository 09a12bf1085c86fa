//! `server.max_connections_per_ip`: how many connections one client address may hold open at
//! once. An IPv6 client counts by its `identity.ipv6_prefix` (a /64 by default, as its rate
//! limits do), an IPv4-mapped IPv6 address as the IPv4 one. Connections from
//! `identity.trusted_proxies` are not capped: each carries many clients.
//!
//! One map for every accept loop (thread-per-core workers share it), behind a mutex held for a
//! hash-map update at connect and at close, never across an `.await`.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv6Addr};
use std::sync::Arc;

use ipnet::IpNet;
use parking_lot::Mutex;

use crate::log_throttle::LogThrottle;

/// Open connections per client address, and the cap.
pub(super) struct PerIp {
    /// Connections one address may hold open.
    cap: u32,
    /// IPv6 addresses count by this prefix.
    ipv6_prefix: u8,
    /// Addresses never capped.
    exempt: Vec<IpNet>,
    /// Open connections by address (absent: none).
    open: Mutex<HashMap<IpAddr, u32>>,
    /// Refusals are logged at most once a second.
    pub(super) log: LogThrottle,
}

/// A connection counted against its address until dropped.
pub(super) struct Counted {
    per_ip: Arc<PerIp>,
    addr: IpAddr,
}

impl Drop for Counted {
    fn drop(&mut self) {
        let mut open = self.per_ip.open.lock();
        if let Some(n) = open.get_mut(&self.addr) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                open.remove(&self.addr);
            }
        }
    }
}

/// What [`PerIp::enter`] decided.
pub(super) enum Entry {
    /// Counted (until the guard drops).
    Counted(Counted),
    /// Not capped (a trusted proxy).
    Exempt,
    /// The address holds `cap` connections already: refuse this one.
    Refused,
}

impl PerIp {
    /// A cap of `cap` connections per address (`None`: no cap, and [`PerIp::enter`] never
    /// refuses).
    pub(super) fn new(cap: Option<usize>, ipv6_prefix: u8, exempt: Vec<IpNet>) -> Option<Arc<Self>> {
        let cap = u32::try_from(cap?).unwrap_or(u32::MAX);
        Some(Arc::new(PerIp {
            cap,
            ipv6_prefix,
            exempt,
            open: Mutex::new(HashMap::new()),
            log: LogThrottle::new(std::time::Duration::from_secs(1)),
        }))
    }

    /// Count a new connection from `ip`, unless its address is at the cap.
    pub(super) fn enter(self: &Arc<Self>, ip: IpAddr) -> Entry {
        let ip = ip.to_canonical();
        if self.exempt.iter().any(|n| n.contains(&ip)) {
            return Entry::Exempt;
        }
        let addr = match ip {
            IpAddr::V4(_) => ip,
            IpAddr::V6(v6) => IpAddr::V6(prefix_of(v6, self.ipv6_prefix)),
        };
        let mut open = self.open.lock();
        let n = open.entry(addr).or_insert(0);
        if *n >= self.cap {
            return Entry::Refused;
        }
        *n += 1;
        Entry::Counted(Counted {
            per_ip: self.clone(),
            addr,
        })
    }
}

/// `v6` with everything past its first `prefix` bits zeroed.
fn prefix_of(v6: Ipv6Addr, prefix: u8) -> Ipv6Addr {
    let bits = u32::from(prefix.min(128));
    let mask = u128::MAX.checked_shl(128 - bits).unwrap_or(0);
    Ipv6Addr::from(u128::from(v6) & mask)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap() // allow-panic: test
    }

    fn cap(n: usize, exempt: &[&str]) -> Arc<PerIp> {
        let exempt = exempt.iter().map(|n| n.parse().unwrap()).collect(); // allow-panic: test
        PerIp::new(Some(n), 64, exempt).unwrap() // allow-panic: test
    }

    #[test]
    fn one_address_holds_at_most_the_cap_and_gets_it_back_on_close() {
        let p = cap(2, &["10.9.0.0/16"]);
        let first = p.enter(ip("192.0.2.1"));
        let second = p.enter(ip("192.0.2.1"));
        assert!(matches!(first, Entry::Counted(_)) && matches!(second, Entry::Counted(_)));
        assert!(matches!(p.enter(ip("192.0.2.1")), Entry::Refused));
        // The IPv4-mapped spelling is the same client.
        assert!(matches!(p.enter(ip("::ffff:192.0.2.1")), Entry::Refused));
        assert!(
            matches!(p.enter(ip("192.0.2.2")), Entry::Counted(_)),
            "another address has its own count"
        );
        drop(first);
        assert!(matches!(p.enter(ip("192.0.2.1")), Entry::Counted(_)));
        // A trusted proxy is never capped.
        assert!((0..5).all(|_| matches!(p.enter(ip("10.9.1.1")), Entry::Exempt)));
    }

    #[test]
    fn ipv6_clients_count_by_their_prefix() {
        let p = cap(1, &[]);
        let _held = p.enter(ip("2001:db8:1:2::1"));
        assert!(matches!(p.enter(ip("2001:db8:1:2:ffff::9")), Entry::Refused));
        assert!(matches!(p.enter(ip("2001:db8:1:3::1")), Entry::Counted(_)));
        assert_eq!(prefix_of("2001:db8::1".parse().unwrap(), 0), Ipv6Addr::UNSPECIFIED); // allow-panic: test
        assert_eq!(prefix_of(Ipv6Addr::LOCALHOST, 128), Ipv6Addr::LOCALHOST);
    }

    #[test]
    fn no_cap_is_no_map() {
        assert!(PerIp::new(None, 64, Vec::new()).is_none());
    }
}
