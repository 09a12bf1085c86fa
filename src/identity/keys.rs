//! The API key registry: SHA-256 hashes of keys → `{id, tier, org}`. Keys themselves are never
//! stored, logged or sent to the store.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;

use sha2::{Digest, Sha256};

use super::keyfile;
use crate::yaml::{parse_str_sized, ConfigError, Sized};

/// Keys a registry may hold unless `limits.max_keys` says otherwise.
pub const DEFAULT_MAX_KEYS: usize = 1_000_000;
use crate::identity::raw::RawKeys;

/// One registered key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyEntry {
    /// The identity used in rules, overrides and logs.
    pub id: Arc<str>,
    /// Tier (`anonymous` when unset).
    pub tier: Arc<str>,
    /// The organisation the key belongs to, for `per: org` rules (`None`: no org).
    pub org: Option<Arc<str>>,
}

/// Hash → entry. Built once per load, then read-only.
#[derive(Debug, Clone, Default)]
pub struct KeyRegistry {
    /// SHA-256 of the key → entry. foldhash: the keys are already uniform hashes, and
    /// SipHash was a tenth of loading a million of them.
    by_hash: HashMap<[u8; 32], KeyEntry, foldhash::fast::RandomState>,
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
    ///
    /// A file in the layout registries are generated in is read by [`super::keyfile`] straight
    /// into the registry (a million keys in about a second); any other file by the YAML parser.
    /// Both give the same registry and the same errors.
    pub fn load_max(path: &Path, max_keys: usize) -> Result<Self, ConfigError> {
        if let Some(read) = Self::read_simple(path, max_keys) {
            return read;
        }
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::file(path, format!("cannot read: {e}")))?;
        let size = Sized {
            entries: max_keys,
            // `{id, sha256, tier, org}`: a map, four keys, four values.
            nodes_per_entry: 12,
            bytes_per_entry: 512,
            what: "limits.max_keys",
        };
        let raw: RawKeys = parse_str_sized(path, &text, size)?;
        drop(text);
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

    /// The registry in `path` when the file is in the simple layout (`None`: parse it as YAML,
    /// which also reports a file that cannot be read).
    fn read_simple(path: &Path, max_keys: usize) -> Option<Result<Self, ConfigError>> {
        // Every entry has one `sha256`: room for all of them at once, no rehashing as it fills.
        let expected = count_sha256(path).ok()?.min(max_keys);
        let file = std::fs::File::open(path).ok()?;
        let mut b = Builder::new(path, expected);
        let scan = keyfile::scan(std::io::BufReader::with_capacity(1 << 20, file), max_keys, |e| {
            let (Some(id), Some(sha)) = (e.id, e.sha256) else {
                return Ok(());
            };
            b.add(NewKey {
                id: (id.text, id.at),
                sha256: (sha.text, sha.at),
                tier: e.tier.map(|t| t.text),
                org: e.org.map(|o| o.text),
            })
        });
        match scan {
            keyfile::Scan::Read { error: Some(e) } => Some(Err(e)),
            keyfile::Scan::Read { error: None } => Some(Ok(b.finish())),
            keyfile::Scan::Other => None,
        }
    }

    /// Validate parsed keys: 64 hex digits each, ids and hashes unique.
    pub fn compile(path: &Path, raw: RawKeys) -> Result<Self, ConfigError> {
        let mut b = Builder::new(path, raw.keys.len());
        let at = |l: &serde_saphyr::Location| (l.line(), l.column());
        for k in raw.keys {
            let k = k.value;
            b.add(NewKey {
                id: (&k.id.value, at(&k.id.referenced)),
                sha256: (&k.sha256.value, at(&k.sha256.referenced)),
                tier: k.tier.as_deref(),
                org: k.org.as_deref(),
            })?;
        }
        Ok(b.finish())
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

    /// How this registry differs from `old`: keys added, keys removed, and keys in both whose
    /// entry changed. Compared in place: a reload of a million keys copies none of them.
    pub fn diff(&self, old: &KeyRegistry) -> (u64, u64, u64) {
        let (mut added, mut changed) = (0, 0);
        for (h, e) in &self.by_hash {
            match old.by_hash.get(h) {
                None => added += 1,
                Some(o) if o != e => changed += 1,
                Some(_) => {}
            }
        }
        let removed = old.by_hash.keys().filter(|h| !self.by_hash.contains_key(*h)).count() as u64;
        (added, removed, changed)
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

/// How many times `sha256` occurs in the file at `path` (at least once per key entry).
fn count_sha256(path: &Path) -> std::io::Result<usize> {
    use std::io::Read;
    const NEEDLE: &[u8] = b"sha256";
    let finder = memchr::memmem::Finder::new(NEEDLE);
    let mut f = std::fs::File::open(path)?;
    let mut buf = vec![0u8; 1 << 20];
    let (mut carry, mut n) = (0, 0);
    loop {
        let read = f.read(&mut buf[carry..])?;
        if read == 0 {
            return Ok(n);
        }
        let end = carry + read;
        n += finder.find_iter(&buf[..end]).count();
        // Keep a needle's length less one: a match across the boundary is counted next time,
        // and none is counted twice.
        let keep = end.min(NEEDLE.len() - 1);
        buf.copy_within(end - keep..end, 0);
        carry = keep;
    }
}

/// One key entry as read, each value with its line and column.
struct NewKey<'a> {
    /// The key's id.
    id: (&'a str, (u64, u64)),
    /// The hex SHA-256 of the key.
    sha256: (&'a str, (u64, u64)),
    /// Its tier, when written.
    tier: Option<&'a str>,
    /// Its org, when written.
    org: Option<&'a str>,
}

/// Builds a registry entry by entry, validating each: 64 hex digits, ids and hashes unique.
struct Builder<'p> {
    path: &'p Path,
    by_hash: HashMap<[u8; 32], KeyEntry, foldhash::fast::RandomState>,
    ids: HashSet<Arc<str>, foldhash::fast::RandomState>,
    /// Tiers and orgs repeat across keys: one shared string each, not one per key (a million
    /// keys in a handful of tiers and thousands of orgs).
    interned: HashSet<Arc<str>, foldhash::fast::RandomState>,
}

impl<'p> Builder<'p> {
    fn new(path: &'p Path, capacity: usize) -> Self {
        Builder {
            path,
            by_hash: HashMap::with_capacity_and_hasher(capacity, Default::default()),
            ids: HashSet::with_capacity_and_hasher(capacity, Default::default()),
            interned: HashSet::default(),
        }
    }

    fn intern(&mut self, s: &str) -> Arc<str> {
        match self.interned.get(s) {
            Some(a) => a.clone(),
            None => {
                let a: Arc<str> = Arc::from(s);
                self.interned.insert(a.clone());
                a
            }
        }
    }

    /// One key: refused (at the position of the value at fault) when its hash is not 64 hex
    /// digits or its id or hash is already taken.
    fn add(&mut self, k: NewKey<'_>) -> Result<(), ConfigError> {
        let NewKey {
            id: (id, id_at),
            sha256: (sha256, sha_at),
            tier,
            org,
        } = k;
        let path = self.path;
        let err = |(line, col): (u64, u64), message: String| ConfigError {
            file: path.to_path_buf(),
            line,
            col,
            message,
        };
        let mut h = [0u8; 32];
        if hex::decode_to_slice(sha256.trim(), &mut h).is_err() {
            return Err(err(
                sha_at,
                "sha256 must be 64 hex digits (use `tollgate hash-key <KEY>`)".to_string(),
            ));
        }
        if id.is_empty() || self.ids.contains(id) {
            return Err(err(id_at, format!("duplicate or empty key id {id:?}")));
        }
        let id: Arc<str> = Arc::from(id);
        self.ids.insert(id.clone());
        let entry = KeyEntry {
            id,
            tier: self.intern(tier.unwrap_or(crate::identity::ANONYMOUS)),
            org: org.map(|o| self.intern(o)),
        };
        if self.by_hash.insert(h, entry).is_some() {
            return Err(err(sha_at, "the same key hash is registered twice".to_string()));
        }
        Ok(())
    }

    fn finish(self) -> KeyRegistry {
        let mut by_hash = self.by_hash;
        by_hash.shrink_to_fit();
        KeyRegistry { by_hash }
    }
}
