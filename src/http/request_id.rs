//! `X-Request-Id`: a valid incoming id is kept, otherwise one is generated —
//! 128 bits as 32 hex digits. Generated ids are a counter mixed with a random per-process key
//! (splitmix64, a bijection: never a repeat within a process, unrelated across processes);
//! one atomic add per 32 ids, no system call, and no allocation of its own per request.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use http::{HeaderName, HeaderValue};

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

/// Ids cut from one allocation: a thread writes this many at a time, and each request's id
/// shares the block (a reference count, no allocation of its own). A block lives until the
/// last of its ids is dropped: at most `ID_BLOCK * 32` bytes held by a long-lived request.
const ID_BLOCK: usize = 32;

thread_local! {
    /// This thread's current block and how many of its ids are taken.
    static IDS: std::cell::RefCell<(bytes::Bytes, usize)> = const { std::cell::RefCell::new((bytes::Bytes::new(), ID_BLOCK)) };
}

/// Write the 32 hex digits of id number `n` into `out`.
fn write_id(g: &Generator, n: u64, out: &mut [u8]) {
    let hi = mix(n ^ g.key[0]);
    let lo = mix(n.wrapping_add(g.key[1]));
    let hex = b"0123456789abcdef";
    for (i, byte) in hi.to_be_bytes().iter().chain(lo.to_be_bytes().iter()).enumerate() {
        out[2 * i] = hex[usize::from(byte >> 4)];
        out[2 * i + 1] = hex[usize::from(byte & 0xf)];
    }
}

/// A new id: 32 lowercase hex digits.
pub fn generate() -> HeaderValue {
    let id = IDS
        .try_with(|ids| {
            let mut ids = ids.try_borrow_mut().ok()?;
            if ids.1 == ID_BLOCK {
                let g = generator();
                let first = g.next.fetch_add(ID_BLOCK as u64, Ordering::Relaxed);
                let mut block = [0u8; 32 * ID_BLOCK];
                for (i, out) in block.chunks_exact_mut(32).enumerate() {
                    write_id(g, first.wrapping_add(i as u64), out);
                }
                // One allocation for the block; every id is a slice of it.
                *ids = (bytes::Bytes::from_owner(block), 0);
            }
            let at = ids.1 * 32;
            ids.1 += 1;
            Some(ids.0.slice(at..at + 32))
        })
        .ok()
        .flatten()
        .unwrap_or_else(|| {
            // Not reachable in practice (the thread is ending, or a nested call): one id alone.
            let g = generator();
            let mut one = [0u8; 32];
            write_id(g, g.next.fetch_add(1, Ordering::Relaxed), &mut one);
            bytes::Bytes::from_owner(one)
        });
    let mut v = HeaderValue::from_maybe_shared(id).unwrap_or(HeaderValue::from_static("0"));
    // Never indexed: no later response on an HTTP/2 connection can reuse it, and an indexed
    // copy would keep its block of ids alive for the connection's life.
    v.set_sensitive(true);
    v
}

/// Is an incoming id worth keeping: 1..=128 characters of letters, digits and `-_.:/+=@`.
pub fn is_valid(v: &HeaderValue) -> bool {
    let b = v.as_bytes();
    !b.is_empty() && b.len() <= MAX_LEN && b.iter().all(|c| c.is_ascii_alphanumeric() || b"-_.:/+=@".contains(c))
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
            assert!(id.is_sensitive(), "never HPACK-indexed (it pins its block of ids)");
            assert!(seen.insert(id), "an id repeated");
        }
    }
}
