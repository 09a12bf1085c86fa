//! `upstream.adaptive`, validated ([`AdaptiveConfig`]), and the rules' priority classes
//! checked against it ([`rule_classes`]).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use serde_saphyr::Spanned;

use super::{raw, Tuning};
use crate::yaml::{duration, ConfigError};

/// How the limit reacts to a window that is too slow (see [`control`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    /// Shrink by how far the latency is over target (to three quarters at most per window).
    Gradient,
    /// Shrink by a fixed factor (`backoff`).
    Aimd,
}

impl Algorithm {
    /// Its name in the config.
    pub fn as_str(self) -> &'static str {
        match self {
            Algorithm::Gradient => "gradient",
            Algorithm::Aimd => "aimd",
        }
    }
}

/// One priority class.
#[derive(Debug, Clone, PartialEq)]
pub struct Class {
    /// Its name.
    pub name: Arc<str>,
    /// The share of the limit kept for it while it uses less (0 to below 1).
    pub guaranteed: f64,
    /// How long one of its requests may wait for room.
    pub queue_timeout: Duration,
}

/// `upstream.adaptive`, validated: every value is in range, the classes have distinct names,
/// their guaranteed shares add up to less than the whole limit, and the default class exists.
#[derive(Debug, Clone, PartialEq)]
pub struct AdaptiveConfig {
    pub(super) tuning: Tuning,
    pub(super) initial: u32,
    pub(super) percentile: u8,
    pub(super) window: Duration,
    pub(super) min_samples: u32,
    pub(super) max_queue: usize,
    pub(super) classes: Vec<Class>,
    pub(super) default_class: usize,
}

impl AdaptiveConfig {
    /// Validate `upstream.adaptive` from `file`.
    pub fn compile(file: &Path, raw: &raw::RawAdaptive) -> Result<Self, ConfigError> {
        let err = |at: &serde_saphyr::Location, m: String| ConfigError::at(file, at, format!("upstream.adaptive.{m}"));
        let algorithm = match &raw.algorithm {
            None => Algorithm::Gradient,
            Some(a) => match a.value.as_str() {
                "gradient" => Algorithm::Gradient,
                "aimd" => Algorithm::Aimd,
                other => {
                    return Err(err(
                        &a.referenced,
                        format!("algorithm: {other:?} is not gradient or aimd"),
                    ))
                }
            },
        };
        let int = |v: &Option<Spanned<i64>>, name: &str, lo: i64, hi: i64, dflt: i64| -> Result<i64, ConfigError> {
            match v {
                None => Ok(dflt),
                Some(s) if (lo..=hi).contains(&s.value) => Ok(s.value),
                Some(s) => Err(err(
                    &s.referenced,
                    format!("{name}: {} is not between {lo} and {hi}", s.value),
                )),
            }
        };
        let min = int(&raw.min, "min", 1, 1_000_000, 4)? as u32;
        let max = int(&raw.max, "max", 1, 1_000_000, 1000.max(i64::from(min)))? as u32;
        if let Some(m) = raw.max.as_ref().filter(|_| max < min) {
            return Err(err(&m.referenced, format!("max: {max} is below min {min}")));
        }
        let initial = int(
            &raw.initial,
            "initial",
            i64::from(min),
            i64::from(max),
            20.clamp(i64::from(min), i64::from(max)),
        )? as u32;
        let float = |v: &Option<Spanned<f64>>, name: &str, lo: f64, hi: f64, dflt: f64| -> Result<f64, ConfigError> {
            match v {
                None => Ok(dflt),
                Some(s) if s.value > lo && s.value <= hi => Ok(s.value),
                Some(s) => Err(err(
                    &s.referenced,
                    format!("{name}: {} must be above {lo} and at most {hi}", s.value),
                )),
            }
        };
        let tolerance = float(&raw.tolerance, "tolerance", 1.0, 10.0, 1.25)?;
        let backoff = float(&raw.backoff, "backoff", 0.5, 0.99, 0.9)?;
        let dur =
            |v: &Option<Spanned<String>>, name: &str, lo: Duration, dflt: Duration| -> Result<Duration, ConfigError> {
                let Some(s) = v else { return Ok(dflt) };
                let d = duration(file, s)?;
                if d < lo || d > Duration::from_secs(60) {
                    return Err(err(
                        &s.referenced,
                        format!("{name}: {:?} is not between {lo:?} and 60s", s.value),
                    ));
                }
                Ok(d)
            };
        let window = dur(
            &raw.window,
            "window",
            Duration::from_millis(10),
            Duration::from_millis(100),
        )?;
        let percentile = int(&raw.percentile, "percentile", 50, 99, 95)? as u8;
        let min_samples = int(&raw.min_samples, "min_samples", 1, super::WINDOW_SAMPLES as i64, 10)? as u32;
        let queue_timeout = dur(
            &raw.queue_timeout,
            "queue_timeout",
            Duration::ZERO,
            Duration::from_millis(20),
        )?;
        let max_queue = int(&raw.max_queue, "max_queue", 0, 1_000_000, 1000)? as usize;
        let classes = match &raw.classes {
            None => default_classes(queue_timeout),
            Some(list) => {
                let mut out: Vec<Class> = Vec::new();
                for c in &list.value {
                    let name = &c.value.name;
                    let ok = !name.value.is_empty()
                        && name.value.len() <= 32
                        && name
                            .value
                            .bytes()
                            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
                    if !ok {
                        return Err(err(
                            &name.referenced,
                            format!("classes: name {:?}: use 1-32 letters, digits, '_', '-'", name.value),
                        ));
                    }
                    if out.iter().any(|o| *o.name == *name.value) {
                        return Err(err(
                            &name.referenced,
                            format!("classes: {:?} is named twice", name.value),
                        ));
                    }
                    let guaranteed = match &c.value.guaranteed {
                        None => 0.0,
                        Some(g) if (0.0..1.0).contains(&g.value) => g.value,
                        Some(g) => {
                            return Err(err(
                                &g.referenced,
                                format!("classes: guaranteed {} is not a share from 0 to below 1", g.value),
                            ))
                        }
                    };
                    out.push(Class {
                        name: Arc::from(name.value.as_str()),
                        guaranteed,
                        queue_timeout: dur(
                            &c.value.queue_timeout,
                            "classes.queue_timeout",
                            Duration::ZERO,
                            queue_timeout,
                        )?,
                    });
                }
                if out.is_empty() || out.len() > 16 {
                    return Err(err(
                        &list.referenced,
                        "classes: give 1 to 16 classes, highest first".into(),
                    ));
                }
                if out.iter().map(|c| c.guaranteed).sum::<f64>() >= 1.0 {
                    return Err(err(
                        &list.referenced,
                        "classes: the guaranteed shares must add up to less than 1".into(),
                    ));
                }
                out
            }
        };
        let default_class = match &raw.default_class {
            Some(d) => classes.iter().position(|c| *c.name == *d.value).ok_or_else(|| {
                err(
                    &d.referenced,
                    format!("default_class: {:?} is not one of the classes", d.value),
                )
            })?,
            None => classes
                .iter()
                .position(|c| &*c.name == "default")
                .unwrap_or(classes.len() - 1),
        };
        Ok(AdaptiveConfig {
            tuning: Tuning {
                algorithm,
                min,
                max,
                tolerance,
                backoff,
            },
            initial,
            percentile,
            window,
            min_samples,
            max_queue,
            classes,
            default_class,
        })
    }

    /// The classes, highest first.
    pub fn classes(&self) -> &[Class] {
        &self.classes
    }

    /// The class of a request no rule names one for.
    pub fn default_class(&self) -> usize {
        self.default_class
    }

    /// The class named `name`, by position (0 is the highest).
    pub fn class_index(&self, name: &str) -> Option<usize> {
        self.classes.iter().position(|c| &*c.name == name)
    }

    /// The controller's settings.
    pub fn tuning(&self) -> Tuning {
        self.tuning
    }

    /// The limit at start.
    pub fn initial(&self) -> u32 {
        self.initial
    }

    /// How often the limit is revised, at the earliest.
    pub fn window(&self) -> Duration {
        self.window
    }

    /// Requests waiting at once, all classes together.
    pub fn max_queue(&self) -> usize {
        self.max_queue
    }
}

/// `critical` (a fifth of the limit kept for it), `default`, `sheddable`.
fn default_classes(queue_timeout: Duration) -> Vec<Class> {
    [("critical", 0.2), ("default", 0.0), ("sheddable", 0.0)]
        .into_iter()
        .map(|(n, g)| Class {
            name: Arc::from(n),
            guaranteed: g,
            queue_timeout,
        })
        .collect()
}

/// A rule that names no priority class (`state::Snapshot::rule_class`).
pub const NO_CLASS: u8 = u8::MAX;

/// Each rule's priority class by position, checked against `adaptive`'s classes: a class
/// that does not exist, or any class without `upstream.adaptive`, is an error at its line.
pub fn rule_classes(
    rules: &crate::rules::RuleSet,
    adaptive: Option<&AdaptiveConfig>,
    file: &std::path::Path,
) -> Result<Vec<u8>, ConfigError> {
    rules
        .rules
        .iter()
        .map(|r| {
            let Some((name, line, col)) = &r.priority else {
                return Ok(NO_CLASS);
            };
            let at = |message: String| ConfigError {
                file: file.to_path_buf(),
                line: *line,
                col: *col,
                message,
            };
            let Some(a) = adaptive else {
                return Err(at(format!(
                    "rule {:?}: priority {name:?} needs upstream.adaptive in the gateway file",
                    r.name
                )));
            };
            a.class_index(name).map(|i| i as u8).ok_or_else(|| {
                let names: Vec<&str> = a.classes().iter().map(|c| &*c.name).collect();
                at(format!(
                    "rule {:?}: priority {name:?} is not one of upstream.adaptive.classes ({})",
                    r.name,
                    names.join(", ")
                ))
            })
        })
        .collect()
}
