//! `admin:` — who may use the admin API. `/healthz`, `/readyz` and `/metrics` are always open;
//! every other endpoint needs the token named by `admin.token_env` once one is configured.
//!
//! tollgate refuses to start with `admin_listen` on a non-loopback address and no token, unless
//! `admin.insecure: true` says that is intended (which is noted, and logged at every start).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde_saphyr::Spanned;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use super::raw::RawAdmin;
use super::ConfigError;

/// The admin token. Only its SHA-256 digest is kept, and `Debug` never prints it.
#[derive(Clone)]
pub struct AdminToken {
    digest: [u8; 32],
}

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminToken(<redacted>)")
    }
}

impl AdminToken {
    /// A token from its secret text.
    pub fn new(secret: &str) -> Self {
        AdminToken {
            digest: Sha256::digest(secret.as_bytes()).into(),
        }
    }

    /// Does `candidate` equal the token? Constant time: the candidate is hashed to 32 bytes
    /// first (so its length and content no longer line up with the secret's bytes), then the
    /// two digests are compared with `subtle::ConstantTimeEq`, which looks at every byte and
    /// has no early exit. How many leading bytes of a guess match changes nothing measurable.
    pub fn matches(&self, candidate: &[u8]) -> bool {
        let d: [u8; 32] = Sha256::digest(candidate).into();
        bool::from(d.ct_eq(&self.digest))
    }
}

/// What a presented admin token may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Every endpoint (no token configured, or a full token).
    Full,
    /// `GET` and `HEAD` only (a `read-only` line of `admin.token_file`).
    ReadOnly,
    /// No valid token.
    Denied,
}

/// The tokens of a token file, each with what it may do.
type Tokens = Vec<(AdminToken, Access)>;

/// What a token file held when last read: its tokens, its modification time then, and when it
/// was last looked at.
type Loaded = (Tokens, Option<std::time::SystemTime>, std::time::Instant);

/// The tokens of `admin.token_file`, re-read when the file changes (checked at most once a
/// second, on an admin request): the old and the new token are both accepted while both lines
/// are in the file, so a token rotates without a restart. A file that stops loading keeps the
/// tokens last read (and says so in the log).
#[derive(Debug)]
pub struct TokenFile {
    /// The file.
    path: PathBuf,
    /// The tokens last read, each with its access, and the file's modification time then.
    tokens: parking_lot::Mutex<Loaded>,
}

impl TokenFile {
    /// Read `path` (at least one token, or an error naming the problem).
    pub fn load(path: &Path) -> Result<Self, String> {
        let (tokens, mtime) = read_tokens(path)?;
        Ok(TokenFile {
            path: path.to_path_buf(),
            tokens: parking_lot::Mutex::new((tokens, mtime, std::time::Instant::now())),
        })
    }

    /// What `candidate` may do, by the file as it is now (re-read first when it changed).
    pub fn access(&self, candidate: &[u8]) -> Access {
        let mut t = self.tokens.lock();
        if t.2.elapsed() >= std::time::Duration::from_secs(1) {
            t.2 = std::time::Instant::now();
            let mtime = std::fs::metadata(&self.path).and_then(|m| m.modified()).ok();
            if mtime != t.1 {
                match read_tokens(&self.path) {
                    Ok((tokens, m)) => {
                        tracing::info!(target: "tollgate::audit", file = %self.path.display(), tokens = tokens.len(), "admin.token_file re-read: the tokens it lists are now the ones accepted");
                        (t.0, t.1) = (tokens, m);
                    }
                    Err(e) => {
                        t.1 = mtime;
                        tracing::error!(file = %self.path.display(), error = %e, "admin.token_file no longer loads; the tokens read before stay in force");
                    }
                }
            }
        }
        // Every token is compared (no early exit), so timing tells nothing about which matched.
        let mut best = Access::Denied;
        for (tok, access) in &t.0 {
            if tok.matches(candidate) && (best == Access::Denied || *access == Access::Full) {
                best = *access;
            }
        }
        best
    }
}

/// The tokens of a token file: one per line, `read-only <token>` for read-only ones; blank
/// lines and `#` comments skipped.
fn read_tokens(path: &Path) -> Result<(Tokens, Option<std::time::SystemTime>), String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let mtime = std::fs::metadata(path).and_then(|m| m.modified()).ok();
    let mut tokens = Vec::new();
    for line in text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        match line.strip_prefix("read-only ") {
            Some(t) if !t.trim().is_empty() => tokens.push((AdminToken::new(t.trim()), Access::ReadOnly)),
            Some(_) => return Err("a read-only line without a token".into()),
            None => tokens.push((AdminToken::new(line), Access::Full)),
        }
    }
    if tokens.is_empty() {
        return Err(format!("{} lists no token", path.display()));
    }
    Ok((tokens, mtime))
}

/// `admin:`, validated.
#[derive(Debug, Clone, Default)]
pub struct AdminConfig {
    /// The token every protected endpoint needs; `None` = the admin API is open (unless
    /// `token_file` is set).
    pub token: Option<AdminToken>,
    /// `admin.token_file`: more tokens, rotatable and read-only ones.
    pub token_file: Option<std::sync::Arc<TokenFile>>,
    /// The environment variable the token came from (for messages; never the value).
    pub token_env: Option<String>,
    /// `admin.insecure: true`: a non-loopback admin listener without a token, on purpose.
    pub insecure: bool,
}

/// Validate `admin:` against `admin_listen` (whose position `listen_at` names, when written).
/// Pushes a note (logged as a warning at every start) when `insecure` is in effect.
pub fn compile(
    file: &Path,
    raw: &RawAdmin,
    admin_listen: SocketAddr,
    listen_at: Option<&Spanned<String>>,
    notes: &mut Vec<String>,
) -> Result<AdminConfig, ConfigError> {
    let (token, token_env) = match &raw.token_env {
        Some(name) => {
            let v = crate::yaml::required_env(file, name, "admin.token_env")?;
            (Some(AdminToken::new(v.trim())), Some(name.value.clone()))
        }
        None => (None, None),
    };
    let token_file = match &raw.token_file {
        Some(f) => {
            let p = if Path::new(&f.value).is_absolute() {
                PathBuf::from(&f.value)
            } else {
                file.parent().unwrap_or(Path::new(".")).join(&f.value)
            };
            let t = TokenFile::load(&p)
                .map_err(|e| ConfigError::at(file, &f.referenced, format!("admin.token_file: {e}")))?;
            Some(std::sync::Arc::new(t))
        }
        None => None,
    };
    let insecure = raw.insecure.as_ref().is_some_and(|i| i.value);
    let exposed = !admin_listen.ip().is_loopback();
    if exposed && token.is_none() && token_file.is_none() {
        if !insecure {
            let msg = format!(
                "admin_listen {admin_listen} is not a loopback address and the admin API has no token: \
                 set admin.token_env (or admin.insecure: true to run it open on purpose)"
            );
            return Err(match listen_at {
                Some(s) => ConfigError::at(file, &s.referenced, msg),
                None => ConfigError::file(file, msg),
            });
        }
        notes.push(format!(
            "admin.insecure: true — the admin API on {admin_listen} has no token: anyone who reaches it can reset counters and reload rules"
        ));
    } else if insecure {
        notes.push("admin.insecure: true has no effect (the admin API has a token or listens on loopback)".to_string());
    }
    Ok(AdminConfig {
        token,
        token_file,
        token_env,
        insecure,
    })
}

impl AdminConfig {
    /// Is any admin token configured?
    pub fn has_token(&self) -> bool {
        self.token.is_some() || self.token_file.is_some()
    }

    /// What a request presenting `candidate` (or nothing) may do.
    pub fn access(&self, candidate: Option<&[u8]>) -> Access {
        if !self.has_token() {
            return Access::Full;
        }
        let Some(c) = candidate else { return Access::Denied };
        if self.token.as_ref().is_some_and(|t| t.matches(c)) {
            return Access::Full;
        }
        self.token_file.as_ref().map_or(Access::Denied, |f| f.access(c))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_matches_only_itself() {
        let t = AdminToken::new("correct horse");
        assert!(t.matches(b"correct horse"));
        assert!(!t.matches(b"correct hors"));
        assert!(!t.matches(b"correct horsf"));
        assert!(!t.matches(b""));
        assert!(!format!("{t:?}").contains("horse"));
    }
}
