//! `X-Request-Id` (DESIGN.md §11): a valid incoming id is kept, otherwise one is generated —
//! 128 bits as 32 hex digits. Generated ids are a counter mixed with a random per-process key
//! (splitmix64, a bijection: never a repeat within a process, unrelated across processes);
//! one atomic add and no system call per request.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use http::{HeaderMap, HeaderName, HeaderValue};

/// `X-Request-Id`.
pub static X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// Longest incoming id kept.
pub const MAX_LEN: usize = 128;

/// 64 random bits from the operating system (ring's `SystemRandom`); the clock if that fails.
pub fn random_u64() -> u64 {
    use ring::rand::SecureRandom;
    let mut b = [0u8; 8];
    match ring::rand::SystemRandom::new().fill(&mut b) {
        Ok(()) => u64::from_le_bytes(b),
        Err(_) => {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64)
                ^ u64::from(std::process::id()).rotate_left(40)
        }
    }
}

/// splitmix64's finaliser: a bijection on u64.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The per-process key and the counter.
struct Generator {
    key: [u64; 2],
    next: AtomicU64,
}

fn generator() -> &'static Generator {
    static G: OnceLock<Generator> = OnceLock::new();
    G.get_or_init(|| Generator {
        key: [random_u64(), random_u64()],
        next: AtomicU64::new(random_u64()),
    })
}

/// A new id: 32 lowercase hex digits.
pub fn generate() -> HeaderValue {
    let g = generator();
    let n = g.next.fetch_add(1, Ordering::Relaxed);
    let hi = mix(n ^ g.key[0]);
    let lo = mix(n.wrapping_add(g.key[1]));
    let mut buf = [0u8; 32];
    let hex = b"0123456789abcdef";
    for (i, byte) in hi.to_be_bytes().iter().chain(lo.to_be_bytes().iter()).enumerate() {
        buf[2 * i] = hex[usize::from(byte >> 4)];
        buf[2 * i + 1] = hex[usize::from(byte & 0xf)];
    }
    // One allocation, and clones (the id goes upstream and back) only count references.
    HeaderValue::from_maybe_shared(bytes::Bytes::from_owner(buf)).unwrap_or(HeaderValue::from_static("0"))
}

/// Is an incoming id worth keeping: 1..=128 characters of letters, digits and `-_.:/+=@`.
pub fn is_valid(v: &HeaderValue) -> bool {
    let b = v.as_bytes();
    !b.is_empty() && b.len() <= MAX_LEN && b.iter().all(|c| c.is_ascii_alphanumeric() || b"-_.:/+=@".contains(c))
}

/// The request's id: its own valid `X-Request-Id` (kept), or a new one written into `h`.
pub fn ensure(h: &mut HeaderMap) -> HeaderValue {
    if let Some(v) = h.get(&X_REQUEST_ID) {
        if is_valid(v) && h.get_all(&X_REQUEST_ID).iter().count() == 1 {
            return v.clone();
        }
    }
    let id = generate();
    h.insert(X_REQUEST_ID.clone(), id.clone());
    id
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_ids_are_32_hex_digits_and_distinct() {
        let mut seen = std::collections::HashSet::new();
        for _ in 0..10_000 {
            let id = generate();
            assert_eq!(id.len(), 32);
            assert!(id.as_bytes().iter().all(|c| c.is_ascii_hexdigit()));
            assert!(seen.insert(id), "an id repeated");
        }
    }

    #[test]
    fn a_valid_id_is_kept_and_a_bad_one_replaced() {
        let mut h = HeaderMap::new();
        h.insert(X_REQUEST_ID.clone(), HeaderValue::from_static("abc-123"));
        assert_eq!(ensure(&mut h), "abc-123");
        let mut h = HeaderMap::new();
        h.insert(X_REQUEST_ID.clone(), HeaderValue::from_static("has space"));
        let id = ensure(&mut h);
        assert_eq!(id.len(), 32);
        assert_eq!(h.get(&X_REQUEST_ID), Some(&id));
        let long = "a".repeat(MAX_LEN + 1);
        let mut h = HeaderMap::new();
        h.insert(X_REQUEST_ID.clone(), HeaderValue::from_str(&long).unwrap()); // allow-panic: test
        assert_ne!(ensure(&mut h), long.as_str());
        let mut h = HeaderMap::new();
        assert_eq!(ensure(&mut h).len(), 32);
    }
}
