//! `admin:` — who may use the admin API. `/healthz`, `/readyz` and `/metrics` are always open;
//! every other endpoint needs the token named by `admin.token_env` once one is configured.
//!
//! tollgate refuses to start with `admin_listen` on a non-loopback address and no token, unless
//! `admin.insecure: true` says that is intended (which is noted, and logged at every start).

use std::net::SocketAddr;
use std::path::Path;

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

/// `admin:`, validated.
#[derive(Debug, Clone, Default)]
pub struct AdminConfig {
    /// The token every protected endpoint needs; `None` = the admin API is open.
    pub token: Option<AdminToken>,
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
        Some(name) => match std::env::var(&name.value) {
            Ok(v) if !v.trim().is_empty() => (Some(AdminToken::new(v.trim())), Some(name.value.clone())),
            Ok(_) => {
                return Err(ConfigError::at(
                    file,
                    &name.referenced,
                    format!("admin.token_env: the environment variable {} is empty", name.value),
                ))
            }
            Err(_) => {
                return Err(ConfigError::at(
                    file,
                    &name.referenced,
                    format!("admin.token_env: the environment variable {} is not set", name.value),
                ))
            }
        },
        None => (None, None),
    };
    let insecure = raw.insecure.as_ref().is_some_and(|i| i.value);
    let exposed = !admin_listen.ip().is_loopback();
    if exposed && token.is_none() {
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
        token_env,
        insecure,
    })
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
