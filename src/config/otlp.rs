//! `tracing.otlp:`: span export over OTLP/HTTP (protobuf), off when absent. See
//! `crate::telemetry` for what is exported and which requests are sampled.

use std::path::Path;
use std::time::Duration;

use super::raw::RawTracing;
use super::{positive_duration, ConfigError, Secret};

/// `sample_ratio` when unset: one allowed request in a hundred.
pub const DEFAULT_SAMPLE_RATIO: f64 = 0.01;
/// `queue_size` when unset.
pub const DEFAULT_QUEUE_SIZE: usize = 2048;

/// The validated `tracing.otlp:`.
#[derive(Debug, Clone)]
pub struct OtlpConfig {
    /// The collector's traces URL (`http://`).
    pub endpoint: http::Uri,
    /// The fraction of allowed requests exported.
    pub sample_ratio: f64,
    /// Follow an incoming sampled flag (W3C trace flags bit 0) for allowed requests.
    pub parent_based: bool,
    /// `service.name`.
    pub service_name: String,
    /// Deadline of one export request.
    pub timeout: Duration,
    /// Spans waiting for export at most.
    pub queue_size: usize,
    /// Headers sent with every export: name, and the value read from the environment.
    pub headers: Vec<(http::HeaderName, Secret)>,
    /// The environment variables the header values came from (for `tollgate config`).
    pub headers_from: Vec<(String, String)>,
}

/// `tracing:` → `None` when export is off.
pub fn compile(f: &Path, raw: &RawTracing) -> Result<Option<OtlpConfig>, ConfigError> {
    let Some(o) = &raw.otlp else { return Ok(None) };
    let o = &o.value;
    let bad = |at: &serde_saphyr::Location, m: String| ConfigError::at(f, at, m);
    let endpoint: http::Uri = o.endpoint.value.parse().map_err(|e| {
        bad(
            &o.endpoint.referenced,
            format!("tracing.otlp.endpoint: {:?} is not a URL ({e})", o.endpoint.value),
        )
    })?;
    if endpoint.scheme_str() != Some("http") || endpoint.authority().is_none() {
        return Err(bad(
            &o.endpoint.referenced,
            format!(
                "tracing.otlp.endpoint: {:?} must be an http:// URL with a host (https is not supported: use a local collector)",
                o.endpoint.value
            ),
        ));
    }
    let sample_ratio = match &o.sample_ratio {
        Some(r) if !(0.0..=1.0).contains(&r.value) => {
            return Err(bad(
                &r.referenced,
                format!("tracing.otlp.sample_ratio: {} is not a fraction in [0, 1]", r.value),
            ))
        }
        Some(r) => r.value,
        None => DEFAULT_SAMPLE_RATIO,
    };
    let service_name = match &o.service_name {
        Some(s) if s.value.trim().is_empty() => {
            return Err(bad(&s.referenced, "tracing.otlp.service_name: empty".into()));
        }
        Some(s) => s.value.clone(),
        None => "tollgate".to_string(),
    };
    let timeout = positive_duration(f, &o.timeout, "tracing.otlp.timeout", Duration::from_secs(5))?;
    let queue_size = match &o.queue_size {
        Some(q) if q.value == 0 => {
            return Err(bad(
                &q.referenced,
                "tracing.otlp.queue_size: 0; it must be at least 1".into(),
            ));
        }
        Some(q) => q.value,
        None => DEFAULT_QUEUE_SIZE,
    };
    let mut headers = Vec::new();
    let mut headers_from = Vec::new();
    for (name, var) in &o.headers_env {
        let n = http::HeaderName::from_bytes(name.as_bytes()).map_err(|_| {
            bad(
                &var.referenced,
                format!("tracing.otlp.headers_env: {name:?} is not a header name"),
            )
        })?;
        let v = crate::yaml::required_env(f, var, "tracing.otlp.headers_env")?;
        if http::HeaderValue::from_str(&v).is_err() {
            return Err(bad(
                &var.referenced,
                format!(
                    "tracing.otlp.headers_env: the value of {} is not a valid header value",
                    var.value
                ),
            ));
        }
        headers_from.push((n.as_str().to_string(), var.value.clone()));
        headers.push((n, Secret(v)));
    }
    Ok(Some(OtlpConfig {
        endpoint,
        sample_ratio,
        parent_based: o.parent_based.unwrap_or(false),
        service_name,
        timeout,
        queue_size,
        headers,
        headers_from,
    }))
}
