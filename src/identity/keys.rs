//! The API key registry: SHA-256 hashes of keys → `{id, tier, org}`. Keys themselves are never
//! stored, logged or sent to the store.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::config::error::{parse_file_sized, ConfigError, Sized};

/// Keys a registry may hold unless `limits.max_keys` says otherwise.
pub const DEFAULT_MAX_KEYS: usize = 1_000_000;
use crate::config::raw::RawKeys;

/// One registered key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyEntry {
    /// The identity used in rules, overrides and logs.
    pub id: Arc<str>,
    /// Tier (`anonymous` when unset).
    pub tier: Arc<str>,
    /// Org.
    pub org: Option<Arc<str>>,
}

/// Hash → entry. Built once per load, then read-only.
#[derive(Debug, Clone, Default)]
pub struct KeyRegistry {
    /// SHA-256 of the key → entry.
    by_hash: HashMap<[u8; 32], KeyEntry>,
}

/// The hex SHA-256 of `key`, as `keys.yaml` wants it.
pub fn hash_key(key: &str) -> String {
    hex::encode(Sha256::digest(key.as_bytes()))
}

impl KeyRegistry {
    /// An empty registry (no `keys_file`).
    pub fn empty() -> Self {
        Self::default()
    }

    /// Load and validate a `keys.yaml` of at most the default `limits.max_keys` keys.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        Self::load_max(path, DEFAULT_MAX_KEYS)
    }

    /// Load and validate a `keys.yaml` of at most `max_keys` keys (`limits.max_keys`).
    pub fn load_max(path: &Path, max_keys: usize) -> Result<Self, ConfigError> {
        let size = Sized {
            entries: max_keys,
            // `{id, sha256, tier, org}`: a map, four keys, four values.
            nodes_per_entry: 12,
            bytes_per_entry: 512,
            what: "limits.max_keys",
        };
        let raw: RawKeys = parse_file_sized(path, size)?;
        if raw.keys.len() > max_keys {
            return Err(ConfigError::file(
                path,
                format!(
                    "{} keys is over limits.max_keys ({max_keys}); raise it in gateway.yaml",
                    raw.keys.len()
                ),
            ));
        }
        Self::compile(path, raw)
    }

    /// Validate parsed keys: 64 hex digits each, ids and hashes unique.
    pub fn compile(path: &Path, raw: RawKeys) -> Result<Self, ConfigError> {
        let mut by_hash = HashMap::with_capacity(raw.keys.len());
        let mut ids = std::collections::HashSet::with_capacity(raw.keys.len());
        // Tiers and orgs repeat across keys: one shared string each, not one per key (a million
        // keys in a handful of tiers and thousands of orgs).
        let mut interned: std::collections::HashSet<Arc<str>> = std::collections::HashSet::new();
        let mut intern = |s: &str| -> Arc<str> {
            match interned.get(s) {
                Some(a) => a.clone(),
                None => {
                    let a: Arc<str> = Arc::from(s);
                    interned.insert(a.clone());
                    a
                }
            }
        };
        for k in raw.keys {
            let k = k.value;
            let mut h = [0u8; 32];
            if hex::decode_to_slice(k.sha256.value.trim(), &mut h).is_err() {
                return Err(ConfigError::at(
                    path,
                    &k.sha256.referenced,
                    "sha256 must be 64 hex digits (use `tollgate hash-key <KEY>`)",
                ));
            }
            let id: Arc<str> = Arc::from(k.id.value.as_str());
            if k.id.value.is_empty() || !ids.insert(id.clone()) {
                return Err(ConfigError::at(
                    path,
                    &k.id.referenced,
                    format!("duplicate or empty key id {:?}", k.id.value),
                ));
            }
            let entry = KeyEntry {
                id,
                tier: intern(k.tier.as_deref().unwrap_or(crate::identity::ANONYMOUS)),
                org: k.org.as_deref().map(&mut intern),
            };
            if by_hash.insert(h, entry).is_some() {
                return Err(ConfigError::at(
                    path,
                    &k.sha256.referenced,
                    "the same key hash is registered twice",
                ));
            }
        }
        Ok(KeyRegistry { by_hash })
    }

    /// The entry for a presented key, if registered.
    pub fn lookup(&self, presented: &[u8]) -> Option<&KeyEntry> {
        if self.by_hash.is_empty() || presented.is_empty() || presented.len() > 4096 {
            return None;
        }
        let h: [u8; 32] = Sha256::digest(presented).into();
        self.by_hash.get(&h)
    }

    /// Every registered key: its SHA-256 and entry (for reload diffs and the admin API).
    pub fn entries(&self) -> impl Iterator<Item = (&[u8; 32], &KeyEntry)> {
        self.by_hash.iter()
    }

    /// True when a registered key has the id `id` (admin lookups; a linear scan).
    pub fn has_id(&self, id: &str) -> bool {
        self.by_hash.values().any(|e| &*e.id == id)
    }

    /// Number of registered keys.
    pub fn len(&self) -> usize {
        self.by_hash.len()
    }

    /// True when no key is registered.
    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }
}
