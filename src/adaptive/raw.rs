//! `upstream.adaptive:` exactly as the YAML says it, before validation. Unknown fields are
//! errors; fields validation may refuse are [`Spanned`] so the error names line and column.

use serde::Deserialize;
use serde_saphyr::Spanned;

/// `upstream.adaptive:`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawAdaptive {
    /// `gradient` (default) or `aimd`.
    pub algorithm: Option<Spanned<String>>,
    /// The floor of the limit.
    pub min: Option<Spanned<i64>>,
    /// The ceiling of the limit.
    pub max: Option<Spanned<i64>>,
    /// The limit at start.
    pub initial: Option<Spanned<i64>>,
    /// How much slower than the learned no-load latency a window's `percentile` may be
    /// before the limit shrinks (`1.25`: 25 % slower).
    pub tolerance: Option<Spanned<f64>>,
    /// The percentile of a window's latencies it is judged by (50 to 99).
    pub percentile: Option<Spanned<i64>>,
    /// `aimd`: the factor a limit is multiplied by when a window is too slow.
    pub backoff: Option<Spanned<f64>>,
    /// How often the limit is revised (at the earliest; a window also needs `min_samples`).
    pub window: Option<Spanned<String>>,
    /// Latencies a window needs before it revises the limit.
    pub min_samples: Option<Spanned<i64>>,
    /// How long a request may wait for room before it is refused (each class's default).
    pub queue_timeout: Option<Spanned<String>>,
    /// Requests waiting at once, all classes together.
    pub max_queue: Option<Spanned<i64>>,
    /// Priority classes, highest first.
    pub classes: Option<Spanned<Vec<Spanned<RawClass>>>>,
    /// The class of a request no rule names a class for.
    pub default_class: Option<Spanned<String>>,
}

/// One entry of `classes:`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawClass {
    /// Its name (`critical`, `default`, `sheddable`, …).
    pub name: Spanned<String>,
    /// The share of the limit kept for it while it uses less (`0.2`: a fifth).
    pub guaranteed: Option<Spanned<f64>>,
    /// Its own `queue_timeout` (`0s`: refused at once when there is no room).
    pub queue_timeout: Option<Spanned<String>>,
}
