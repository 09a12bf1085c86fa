//! Raw serde structs: exactly what the YAML says, before validation. Unknown fields are errors.
//! Fields that validation may refuse are [`Spanned`] so the error names line and column.

use serde::Deserialize;
use serde_saphyr::Spanned;

/// `identity.jwt:`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawJwt {
    /// Header carrying `Bearer <token>`.
    pub header: Option<String>,
    /// Accepted algorithms.
    pub algorithms: Spanned<Vec<String>>,
    /// PEM public key (RS*/ES*/EdDSA).
    pub public_key_file: Option<Spanned<String>>,
    /// Env var with the HMAC secret (HS*).
    pub secret_env: Option<Spanned<String>>,
    /// A JWKS file (RFC 7517) of public keys, selected by the token's `kid`; re-read when it changes.
    pub jwks_file: Option<Spanned<String>>,
    /// Required `iss`.
    pub issuer: Option<String>,
    /// Required `aud`.
    pub audience: Option<String>,
    /// Claim naming the user.
    pub user_claim: Option<String>,
    /// Claim naming the tier.
    pub tier_claim: Option<String>,
    /// Claim naming the org.
    pub org_claim: Option<String>,
    /// Clock leeway for exp/nbf.
    pub leeway: Option<Spanned<String>>,
}

/// `keys.yaml`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawKeys {
    /// Registered keys.
    #[serde(default)]
    pub keys: Vec<Spanned<RawKey>>,
}

/// One API key.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawKey {
    /// Identity used in rules and logs.
    pub id: Spanned<String>,
    /// Hex SHA-256 of the key.
    pub sha256: Spanned<String>,
    /// The tier rules can match on (`anonymous` when unset).
    pub tier: Option<String>,
    /// The organisation, for `per: org` rules.
    pub org: Option<String>,
}
