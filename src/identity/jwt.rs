//! JWT verification. Tokens are checked against the configured keys, which reload with the
//! rules ([`JwtKeys`]: a rotated public key or JWKS file needs no restart); `exp`, `nbf`, `iss`
//! and `aud` are checked against an injected `now` with leeway. Any failure (`alg: none`, an
//! algorithm outside the configured family, a bad signature, an expired token) yields `None`
//! from [`JwtKeys::verify`], and [`CredentialProblem::Invalid`] from
//! [`JwtKeys::verify_headers`] (what the request then gets is `identity.invalid_credentials`).
//! `exp` and `nbf` may be fractional (RFC 7519 NumericDate): `exp` is rounded down and `nbf`
//! up, so rounding never widens a token's validity.

use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;

use http::{HeaderMap, HeaderName};
use jsonwebtoken::{Algorithm, AlgorithmFamily, DecodingKey, Validation};
use serde_json::Value;
use sha2::Digest;

use crate::identity::raw::RawJwt;
use crate::identity::CredentialProblem;
use crate::yaml::{duration, ConfigError};

/// Claims the gateway uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JwtClaims {
    /// The user (from `user_claim`).
    pub user: Arc<str>,
    /// The tier (from `tier_claim`).
    pub tier: Option<Arc<str>>,
    /// The org (from `org_claim`).
    pub org: Option<Arc<str>>,
}

/// One verification key and the algorithms it may verify.
struct KeySpec {
    /// `kid` from a JWKS, if any.
    kid: Option<String>,
    /// The verifying key, of one family only (HMAC, RSA, EC or EdDSA).
    key: DecodingKey,
    /// Algorithms of the key's family that the config allows.
    algorithms: Vec<Algorithm>,
}

/// Compiled JWT settings.
pub struct JwtVerifier {
    /// Header carrying `Bearer <token>`.
    header: HeaderName,
    /// Verification keys.
    keys: Vec<KeySpec>,
    /// Required issuer.
    issuer: Option<String>,
    /// Required audience.
    audience: Option<String>,
    /// Claim naming the user.
    user_claim: String,
    /// Claim naming the tier.
    tier_claim: String,
    /// Claim naming the org.
    org_claim: String,
    /// Seconds of clock leeway.
    leeway: u64,
    /// Verified tokens by SHA-256: signature checks cost ~100 µs (RS256), and a client sends
    /// the same token many times. Only tokens that verified are kept, with their `exp`/`nbf`,
    /// which are re-checked against `now` on every hit. Bounded: cleared when full.
    cache: parking_lot::Mutex<std::collections::HashMap<[u8; 32], Cached>>,
}

/// A verified token's claims and its validity window.
#[derive(Debug, Clone)]
struct Cached {
    /// The claims the gateway uses.
    claims: JwtClaims,
    /// `exp`, seconds.
    exp: u64,
    /// `nbf`, seconds (0 when absent).
    nbf: u64,
}

/// Verified tokens remembered at most.
const CACHE_MAX: usize = 10_000;

impl std::fmt::Debug for JwtVerifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never prints key material.
        f.debug_struct("JwtVerifier")
            .field("header", &self.header)
            .field("keys", &self.keys.len())
            .field("issuer", &self.issuer)
            .field("audience", &self.audience)
            .field("leeway", &self.leeway)
            .finish()
    }
}

/// The JWT verifier in force, recompiled from its key files on every reload (SIGHUP,
/// `POST /reload`, or a change the watcher sees in `public_key_file` / `jwks_file`) and swapped
/// whole; a key file that does not load leaves the previous keys in force.
pub struct JwtKeys {
    /// The verifier requests use.
    current: arc_swap::ArcSwap<JwtVerifier>,
    /// The gateway file (for error positions).
    file: PathBuf,
    /// Key files are relative to this directory.
    dir: PathBuf,
    /// `identity.jwt` as written.
    raw: RawJwt,
}

impl std::fmt::Debug for JwtKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("JwtKeys").field(&*self.current.load()).finish()
    }
}

impl JwtKeys {
    /// The header the token is read from.
    pub fn header(&self) -> HeaderName {
        self.current.load().header.clone()
    }

    /// Compile `identity.jwt` now (key files relative to `dir`).
    pub fn compile(file: &Path, dir: &Path, raw: &RawJwt) -> Result<Self, ConfigError> {
        let v = JwtVerifier::compile(file, dir, raw)?;
        Ok(JwtKeys {
            current: arc_swap::ArcSwap::from_pointee(v),
            file: file.to_path_buf(),
            dir: dir.to_path_buf(),
            raw: raw.clone(),
        })
    }

    /// The key files to watch.
    pub fn files(&self) -> Vec<PathBuf> {
        [&self.raw.public_key_file, &self.raw.jwks_file]
            .into_iter()
            .flatten()
            .map(|s| self.dir.join(&s.value))
            .collect()
    }

    /// Compile the keys from disk again, without installing them.
    pub fn prepare(&self) -> Result<JwtVerifier, ConfigError> {
        JwtVerifier::compile(&self.file, &self.dir, &self.raw)
    }

    /// Put `v` in force.
    pub fn install(&self, v: JwtVerifier) {
        self.current.store(Arc::new(v));
    }

    /// The claims of the bearer token in the configured header: `Ok(None)` when the header is
    /// absent or carries another scheme, an error when it is sent twice or its token does not
    /// verify.
    pub fn verify_headers(&self, headers: &HeaderMap, now_secs: u64) -> Result<Option<JwtClaims>, CredentialProblem> {
        self.current.load().verify_headers(headers, now_secs)
    }

    /// Verify `token` at `now_secs`.
    pub fn verify(&self, token: &str, now_secs: u64) -> Option<JwtClaims> {
        self.current.load().verify(token, now_secs)
    }
}

/// The largest `identity.jwt.leeway` accepted: clock skew is seconds, not hours.
const MAX_LEEWAY: std::time::Duration = std::time::Duration::from_secs(300);

/// The token of a `Bearer` credential: the scheme matched case-insensitively, then any run of
/// spaces or tabs (RFC 9110 §11.4). `None` for another scheme.
fn bearer_token(v: &[u8]) -> Option<&[u8]> {
    let v = v.trim_ascii();
    let (scheme, rest) = match v.iter().position(|&b| b == b' ' || b == b'\t') {
        Some(i) => (&v[..i], &v[i..]),
        None => (v, &v[v.len()..]),
    };
    scheme.eq_ignore_ascii_case(b"bearer").then(|| rest.trim_ascii())
}

/// A NumericDate (RFC 7519 §2, possibly fractional) as whole seconds: rounded up when `up`,
/// else down. `None` for a negative or non-numeric value.
fn numeric_date(v: &Value, up: bool) -> Option<u64> {
    if let Some(n) = v.as_u64() {
        return Some(n);
    }
    let f = v.as_f64().filter(|f| f.is_finite() && *f >= 0.0)?;
    // `as` saturates: a date past u64 seconds is u64::MAX.
    Some(if up { f.ceil() } else { f.floor() } as u64)
}

/// `identity.jwt.leeway`: 30 s when absent, at most [`MAX_LEEWAY`].
fn leeway(file: &Path, raw: &RawJwt) -> Result<u64, ConfigError> {
    Ok(match &raw.leeway {
        Some(l) => {
            let d = duration(file, l)?;
            if d > MAX_LEEWAY {
                return Err(ConfigError::at(
                    file,
                    &l.referenced,
                    format!(
                        "identity.jwt.leeway: {:?} is more than 5m, which would accept long-expired tokens",
                        l.value
                    ),
                ));
            }
            d.as_secs()
        }
        None => 30,
    })
}

/// `identity.jwt.algorithms`: known names, never `none`, not empty, and one family only; also
/// whether that family is HMAC.
fn algorithms(file: &Path, raw: &RawJwt) -> Result<(Vec<Algorithm>, bool), ConfigError> {
    let mut algorithms = Vec::new();
    for a in &raw.algorithms.value {
        if a.eq_ignore_ascii_case("none") {
            return Err(ConfigError::at(
                file,
                &raw.algorithms.referenced,
                "jwt algorithm \"none\" is never accepted",
            ));
        }
        let alg = Algorithm::from_str(a)
            .map_err(|_| ConfigError::at(file, &raw.algorithms.referenced, format!("unknown jwt algorithm {a:?}")))?;
        algorithms.push(alg);
    }
    if algorithms.is_empty() {
        return Err(ConfigError::at(
            file,
            &raw.algorithms.referenced,
            "jwt.algorithms is empty",
        ));
    }
    let hmac = algorithms.iter().any(|a| a.family() == AlgorithmFamily::Hmac);
    let public = algorithms.iter().any(|a| a.family() != AlgorithmFamily::Hmac);
    if hmac && public {
        return Err(ConfigError::at(
            file,
            &raw.algorithms.referenced,
            "jwt.algorithms mixes HS* with RS*/ES*: one key family only (prevents algorithm confusion)",
        ));
    }
    Ok((algorithms, hmac))
}

/// The verifying keys: an HMAC secret from the environment, a PEM public key, or a JWKS, each
/// kept with the configured algorithms of its own family. At least one key, or an error.
fn keys(
    file: &Path,
    dir: &Path,
    raw: &RawJwt,
    algorithms: &[Algorithm],
    hmac: bool,
) -> Result<Vec<KeySpec>, ConfigError> {
    if let (Some(env), true) = (
        &raw.secret_env,
        raw.public_key_file.is_some() || raw.jwks_file.is_some(),
    ) {
        return Err(ConfigError::at(
            file,
            &env.referenced,
            "jwt: choose one: secret_env (HS*) or public_key_file / jwks_file (RS*/ES*/EdDSA), not both",
        ));
    }
    let mut keys = Vec::new();
    let read = |s: &serde_saphyr::Spanned<String>| -> Result<Vec<u8>, ConfigError> {
        let p = dir.join(&s.value);
        std::fs::read(&p).map_err(|e| ConfigError::at(file, &s.referenced, format!("cannot read {}: {e}", p.display())))
    };
    if let Some(env) = &raw.secret_env {
        if !hmac {
            return Err(ConfigError::at(
                file,
                &env.referenced,
                "secret_env needs HS* algorithms",
            ));
        }
        let secret = crate::yaml::required_env(file, env, "identity.jwt.secret_env")?;
        if secret.len() < 16 {
            return Err(ConfigError::at(
                file,
                &env.referenced,
                "HMAC secret shorter than 16 bytes",
            ));
        }
        keys.push(KeySpec {
            kid: None,
            key: DecodingKey::from_secret(secret.as_bytes())
                .map_err(|e| ConfigError::at(file, &env.referenced, format!("invalid HMAC secret: {e}")))?,
            algorithms: algorithms.to_vec(),
        });
    }
    if let Some(pem_file) = &raw.public_key_file {
        if hmac {
            return Err(ConfigError::at(
                file,
                &pem_file.referenced,
                "public_key_file needs RS*/ES*/EdDSA algorithms",
            ));
        }
        let pem = read(pem_file)?;
        let key = DecodingKey::from_rsa_pem(&pem)
            .or_else(|_| DecodingKey::from_ec_pem(&pem))
            .or_else(|_| DecodingKey::from_ed_pem(&pem))
            .map_err(|e| ConfigError::at(file, &pem_file.referenced, format!("not a PEM public key: {e}")))?;
        let fam = key.family();
        let algs: Vec<Algorithm> = algorithms.iter().copied().filter(|a| a.family() == fam).collect();
        if algs.is_empty() {
            return Err(ConfigError::at(
                file,
                &pem_file.referenced,
                "the key's type matches none of jwt.algorithms",
            ));
        }
        keys.push(KeySpec {
            kid: None,
            key,
            algorithms: algs,
        });
    }
    if let Some(jwks_file) = &raw.jwks_file {
        let bytes = read(jwks_file)?;
        let set: jsonwebtoken::jwk::JwkSet = serde_json::from_slice(&bytes)
            .map_err(|e| ConfigError::at(file, &jwks_file.referenced, format!("invalid JWKS: {e}")))?;
        for jwk in &set.keys {
            let Ok(key) = DecodingKey::from_jwk(jwk) else { continue };
            let fam = key.family();
            let algs: Vec<Algorithm> = algorithms.iter().copied().filter(|a| a.family() == fam).collect();
            if !algs.is_empty() {
                keys.push(KeySpec {
                    kid: jwk.common.key_id.clone(),
                    key,
                    algorithms: algs,
                });
            }
        }
    }
    if keys.is_empty() {
        return Err(ConfigError::at(
            file,
            &raw.algorithms.referenced,
            "jwt needs a key: public_key_file, secret_env or jwks_file",
        ));
    }
    Ok(keys)
}

/// Tokens longer than this are not even parsed.
const MAX_TOKEN_BYTES: usize = 16 * 1024;

impl JwtVerifier {
    /// Compile `identity.jwt` (key files relative to `dir`): the leeway, the one algorithm family,
    /// then the keys of that family. Every refusal names the field at fault.
    pub fn compile(file: &Path, dir: &Path, raw: &RawJwt) -> Result<Self, ConfigError> {
        let leeway = leeway(file, raw)?;
        let (algorithms, hmac) = algorithms(file, raw)?;
        let keys = keys(file, dir, raw, &algorithms, hmac)?;
        Ok(JwtVerifier {
            header: raw
                .header
                .as_deref()
                .map(|h| HeaderName::from_bytes(h.as_bytes()))
                .transpose()
                .map_err(|_| ConfigError::file(file, "jwt.header: invalid header name"))?
                .unwrap_or(http::header::AUTHORIZATION),
            keys,
            issuer: raw.issuer.clone(),
            audience: raw.audience.clone(),
            user_claim: raw.user_claim.clone().unwrap_or_else(|| "sub".into()),
            tier_claim: raw.tier_claim.clone().unwrap_or_else(|| "tier".into()),
            org_claim: raw.org_claim.clone().unwrap_or_else(|| "org".into()),
            leeway,
            cache: parking_lot::Mutex::new(std::collections::HashMap::new()),
        })
    }

    /// The claims of the bearer token in the configured header: `Ok(None)` when the header is
    /// absent or carries another scheme, an error when it is sent twice or its token does not
    /// verify.
    pub fn verify_headers(&self, headers: &HeaderMap, now_secs: u64) -> Result<Option<JwtClaims>, CredentialProblem> {
        let mut fields = headers.get_all(&self.header).iter();
        let Some(v) = fields.next() else { return Ok(None) };
        if fields.next().is_some() {
            return Err(CredentialProblem::Ambiguous("more than one bearer token header field"));
        }
        let Some(token) = bearer_token(v.as_bytes()) else {
            return Ok(None);
        };
        let token = std::str::from_utf8(token).map_err(|_| CredentialProblem::Invalid)?;
        self.verify(token, now_secs).map(Some).ok_or(CredentialProblem::Invalid)
    }

    /// Verify a compact JWS. `None` for anything but a valid, current token.
    pub fn verify(&self, token: &str, now_secs: u64) -> Option<JwtClaims> {
        if token.is_empty() || token.len() > MAX_TOKEN_BYTES {
            return None;
        }
        let digest: [u8; 32] = sha2::Sha256::digest(token.as_bytes()).into();
        if let Some(c) = self.cache.lock().get(&digest) {
            return self.current(c, now_secs).then(|| c.claims.clone());
        }
        let (claims, exp, nbf) = self.verify_uncached(token)?;
        let c = Cached { claims, exp, nbf };
        if !self.current(&c, now_secs) {
            return None;
        }
        let mut cache = self.cache.lock();
        if cache.len() >= CACHE_MAX {
            cache.clear();
        }
        cache.insert(digest, c.clone());
        Some(c.claims)
    }

    /// Is a verified token within `exp`/`nbf` (with leeway) at `now`?
    fn current(&self, c: &Cached, now_secs: u64) -> bool {
        now_secs <= c.exp.saturating_add(self.leeway) && c.nbf <= now_secs.saturating_add(self.leeway)
    }

    /// Signature, algorithm, `iss` and `aud` checks; returns the claims with `exp` and `nbf`.
    fn verify_uncached(&self, token: &str) -> Option<(JwtClaims, u64, u64)> {
        let header = jsonwebtoken::decode_header(token).ok()?;
        let spec = self.keys.iter().find(|k| {
            k.algorithms.contains(&header.alg)
                && match (&k.kid, &header.kid) {
                    (Some(a), Some(b)) => a == b,
                    (Some(_), None) => false,
                    (None, _) => true,
                }
        })?;
        let mut v = Validation::new(header.alg);
        v.algorithms = spec.algorithms.clone();
        // exp/nbf are checked below against the injected clock.
        v.validate_exp = false;
        v.validate_nbf = false;
        v.required_spec_claims.clear();
        v.validate_aud = false;
        let data = jsonwebtoken::decode::<serde_json::Map<String, Value>>(token, &spec.key, &v).ok()?;
        let c = data.claims;
        let exp = numeric_date(c.get("exp")?, false)?;
        let nbf = match c.get("nbf") {
            Some(n) => numeric_date(n, true)?,
            None => 0,
        };
        if let Some(iss) = &self.issuer {
            if c.get("iss")?.as_str()? != iss {
                return None;
            }
        }
        if let Some(aud) = &self.audience {
            let ok = match c.get("aud")? {
                Value::String(s) => s == aud,
                Value::Array(a) => a.iter().any(|x| x.as_str() == Some(aud)),
                _ => false,
            };
            if !ok {
                return None;
            }
        }
        let text = |name: &str| -> Option<Arc<str>> {
            match c.get(name)? {
                Value::String(s) if !s.is_empty() && s.len() <= 256 => Some(Arc::from(s.as_str())),
                Value::Number(n) => Some(Arc::from(n.to_string())),
                _ => None,
            }
        };
        let claims = JwtClaims {
            user: text(&self.user_claim)?,
            tier: text(&self.tier_claim),
            org: text(&self.org_claim),
        };
        Some((claims, exp, nbf))
    }
}
