//! `rls:` in gateway.yaml: where the Envoy rate-limit service listens and where its
//! envoyproxy/ratelimit config directory is. The directory's files are read by `crate::rls`
//! (ARCHITECTURE.md, "The Envoy rate-limit service").

use std::net::SocketAddr;
use std::num::NonZeroU32;
use std::path::{Path, PathBuf};

use serde_saphyr::Spanned;

use super::raw::RawRls;
use crate::limiter::FailurePolicy;
use crate::yaml::ConfigError;

/// Which rate-limit headers the service asks Envoy to add to the response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RlsHeaders {
    /// None (envoyproxy/ratelimit's default).
    #[default]
    None,
    /// IETF `RateLimit` and `RateLimit-Policy`.
    Ietf,
    /// envoyproxy/ratelimit's `X-RateLimit-Limit`, `-Remaining`, `-Reset`.
    XRateLimit,
}

/// The validated `rls:` section.
#[derive(Debug, Clone)]
pub struct RlsSettings {
    /// The listener; `None`: `tollgate run` serves no rate-limit service.
    pub listen: Option<SocketAddr>,
    /// The config directory (absolute, or relative to the working directory).
    pub config_dir: PathBuf,
    /// Where `config_dir` is written in the gateway file (line, column).
    pub config_dir_at: (u64, u64),
    /// Failure policy of domains and descriptors that name none.
    pub failure: FailurePolicy,
    /// Response headers for Envoy to add.
    pub headers: RlsHeaders,
}

/// The address `tollgate rls` listens on when `rls.listen` is not set (Envoy Gateway's).
pub const DEFAULT_RLS_LISTEN: &str = "0.0.0.0:8081";

/// Validate `rls:` of `file` (whose directory is `dir`).
pub fn compile(file: &Path, dir: &Path, raw: &Spanned<RawRls>) -> Result<RlsSettings, ConfigError> {
    let r = &raw.value;
    let listen = match &r.listen {
        Some(s) => Some(s.value.parse().map_err(|_| {
            ConfigError::at(
                file,
                &s.referenced,
                format!("rls.listen: invalid address {:?} (want ip:port)", s.value),
            )
        })?),
        None => None,
    };
    if r.config_dir.value.is_empty() {
        return Err(ConfigError::at(
            file,
            &r.config_dir.referenced,
            "rls.config_dir is empty",
        ));
    }
    let p = Path::new(&r.config_dir.value);
    let config_dir = if p.is_absolute() { p.to_path_buf() } else { dir.join(p) };
    let failure = failure_of(file, r.failure.as_ref(), FailurePolicy::Open)?;
    let headers = match r.headers.as_ref().map(|h| (h.value.as_str(), h)) {
        None | Some(("none", _)) => RlsHeaders::None,
        Some(("ietf", _)) => RlsHeaders::Ietf,
        Some(("x-ratelimit", _)) => RlsHeaders::XRateLimit,
        Some((other, h)) => {
            return Err(ConfigError::at(
                file,
                &h.referenced,
                format!("rls.headers: unknown value {other:?} (none | ietf | x-ratelimit)"),
            ))
        }
    };
    Ok(RlsSettings {
        listen,
        config_dir,
        config_dir_at: (r.config_dir.referenced.line(), r.config_dir.referenced.column()),
        failure,
        headers,
    })
}

/// A failure policy as written (`open`, `closed`, `local`), `default` when absent.
pub fn failure_of(
    file: &Path,
    f: Option<&Spanned<String>>,
    default: FailurePolicy,
) -> Result<FailurePolicy, ConfigError> {
    Ok(match f.map(|f| (f.value.as_str(), f)) {
        None => default,
        Some(("open", _)) => FailurePolicy::Open,
        Some(("closed", _)) => FailurePolicy::Closed,
        Some(("local", _)) => FailurePolicy::Local { share: NonZeroU32::MIN },
        Some((other, f)) => {
            return Err(ConfigError::at(
                file,
                &f.referenced,
                format!("unknown failure policy {other:?} (open | closed | local)"),
            ))
        }
    })
}
