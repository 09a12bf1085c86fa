//! The store key schema, in one place: `{prefix}:{<tag>}:<rule>:<n>`.
//!
//! * `<tag>` is a salted SHA-256 of the key value and its **namespace** (what kind of value it
//!   is), hex, 24 characters. No caller-controlled byte reaches the store, no secret either,
//!   and with a salt no caller can aim at a chosen Redis Cluster slot. The namespace keeps a
//!   JWT `sub` of `10.8.8.8`, an API key id and the client IP 10.8.8.8 on three different
//!   counters. A `user` rule for an anonymous caller uses the IP namespace, so its counters
//!   share the slot (and the one script call) of the caller's `ip` rules.
//! * `<rule>` is the rule name; `<n>` the position of the limit in the rule's list (0 for a
//!   single limit). The key does not name the algorithm, window or rate: a reload that changes
//!   them keeps the key, and the store converts the state it finds (conservatively: see
//!   `algorithm::used`), so a reload never hands out a fresh quota.

use std::sync::Arc;

use sha2::{Digest, Sha256};
use smallvec::SmallVec;

use super::StoreKey;

/// A key's tag: 24 lowercase hex digits, kept inline (copying it allocates nothing).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Tag([u8; 24]);

impl Tag {
    /// Hex of the first 12 bytes of `digest`.
    fn of(digest: &[u8]) -> Tag {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut t = [b'0'; 24];
        for (i, b) in digest.iter().take(12).enumerate() {
            t[2 * i] = HEX[usize::from(b >> 4)];
            t[2 * i + 1] = HEX[usize::from(b & 0xf)];
        }
        Tag(t)
    }

    /// The tag as text.
    pub fn as_str(&self) -> &str {
        // Only hex digits are ever written.
        std::str::from_utf8(&self.0).unwrap_or_default()
    }
}

impl std::ops::Deref for Tag {
    type Target = str;
    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl std::fmt::Display for Tag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::fmt::Debug for Tag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tag({})", self.as_str())
    }
}

/// What kind of value a counter is shared by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Namespace {
    /// A client IP (IPv6 collapsed to its prefix): `ip` rules, and `user` rules for callers
    /// known only by their IP.
    Ip,
    /// A JWT user (`user_claim`).
    Jwt,
    /// An API key id from the registry.
    ApiKey,
    /// An org.
    Org,
    /// A request header's value.
    Header,
    /// An Envoy rate-limit descriptor (domain, entries' keys and values).
    Descriptor,
}

impl Namespace {
    /// The bytes mixed into the hash; distinct per namespace.
    fn domain(self) -> &'static [u8] {
        match self {
            Namespace::Ip => b"ip",
            Namespace::Jwt => b"jwt",
            Namespace::ApiKey => b"key",
            Namespace::Org => b"org",
            Namespace::Header => b"header",
            Namespace::Descriptor => b"rls",
        }
    }
}

/// Builds store keys (see the module docs).
#[derive(Debug, Clone)]
pub struct KeyBuilder {
    /// `store.key_prefix`.
    pub prefix: String,
    /// Secret mixed into every hash.
    pub salt: String,
}

impl KeyBuilder {
    /// The tag of `value` in namespace `ns`.
    pub fn tag(&self, ns: Namespace, value: &[u8]) -> Tag {
        let mut h = Sha256::new();
        h.update(self.salt.as_bytes());
        h.update([0]);
        h.update(ns.domain());
        h.update([0]);
        h.update(value);
        Tag::of(&h.finalize())
    }

    /// The tag of `rule`'s one global counter.
    pub fn global_tag(&self, rule: &str) -> Tag {
        let mut h = Sha256::new();
        h.update(self.salt.as_bytes());
        h.update([0]);
        h.update(b"\0global\0");
        h.update(rule.as_bytes());
        Tag::of(&h.finalize())
    }

    /// The key of the `n`-th limit of `rule` under `tag`. Written on the stack, then copied
    /// into its one shared allocation.
    pub fn key(&self, tag: &str, rule: &str, n: usize) -> StoreKey {
        let mut s = SmallVec::<[u8; 160]>::new();
        s.extend_from_slice(self.prefix.as_bytes());
        s.extend_from_slice(b":{");
        s.extend_from_slice(tag.as_bytes());
        s.extend_from_slice(b"}:");
        s.extend_from_slice(rule.as_bytes());
        s.push(b':');
        s.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
        // Only `&str`s were appended, so this is UTF-8.
        StoreKey(Arc::from(std::str::from_utf8(&s).unwrap_or_default()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kb(salt: &str) -> KeyBuilder {
        KeyBuilder {
            prefix: "tl".into(),
            salt: salt.into(),
        }
    }

    #[test]
    fn keys_hash_the_value_and_name_rule_and_position() {
        let evil = b"x}:{evil\r\nDEL *";
        let tag = kb("s").tag(Namespace::Header, evil);
        assert!(tag.bytes().all(|b| b.is_ascii_hexdigit()), "{tag}");
        let key = kb("s").key(&tag, "search", 1);
        assert_eq!(key.as_str(), format!("tl:{{{tag}}}:search:1"));
        assert!(!key.as_str().contains("evil"));
        // A different salt moves the caller to another tag (the caller can't aim at a slot).
        assert_ne!(kb("other").tag(Namespace::Header, evil), tag);
        // Global counters are per rule.
        assert_ne!(kb("s").global_tag("a"), kb("s").global_tag("b"));
    }

    #[test]
    fn tags_are_the_hex_of_the_first_12_digest_bytes() {
        // The Redis key schema: a tag is what `hex::encode` of the digest's first 12 bytes was.
        let k = kb("s");
        let mut h = Sha256::new();
        h.update(b"s");
        h.update([0]);
        h.update(b"ip");
        h.update([0]);
        h.update(b"10.8.8.8");
        assert_eq!(
            k.tag(Namespace::Ip, b"10.8.8.8").as_str(),
            hex::encode(&h.finalize()[..12])
        );
    }

    #[test]
    fn namespaces_never_share_a_counter() {
        let k = kb("s");
        let v = b"10.8.8.8";
        let tags: Vec<Tag> = [
            Namespace::Ip,
            Namespace::Jwt,
            Namespace::ApiKey,
            Namespace::Org,
            Namespace::Header,
            Namespace::Descriptor,
        ]
        .iter()
        .map(|ns| k.tag(*ns, v))
        .collect();
        for (i, a) in tags.iter().enumerate() {
            for b in &tags[i + 1..] {
                assert_ne!(a, b);
            }
        }
    }
}
