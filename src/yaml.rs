//! Reading settings files, below every subsystem: errors that name `file:line:col`, YAML parsing
//! into a subsystem's raw structs (with size limits), durations, and [`Secret`], a value that is
//! never printed. It uses nothing else of the crate, so each subsystem compiles its own part of
//! the config with it, and `config` (which composes them) sits above them all
//! (ARCHITECTURE.md, "Layering").

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_saphyr::{Location, Spanned};

/// A config error, rendered `file:line:col: message`.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{}: {message}", Position(self))]
pub struct ConfigError {
    /// The file at fault (the gateway file, or the rules or keys file it names).
    pub file: PathBuf,
    /// 1-based line (0 when unknown).
    pub line: u64,
    /// 1-based column (0 when unknown).
    pub col: u64,
    /// What is wrong.
    pub message: String,
}

impl ConfigError {
    /// An error about a whole file named in the gateway file (it cannot be read): point at the
    /// line that names it, `at` in `gateway`, instead of at no position in the file itself.
    pub fn named_in(self, gateway: &Path, field: &str, at: Option<(u64, u64)>) -> Self {
        match at {
            Some((line, col)) if self.line == 0 => ConfigError {
                message: format!("{field} {}: {}", self.file.display(), self.message),
                file: gateway.to_path_buf(),
                line,
                col,
            },
            _ => self,
        }
    }

    /// An error at `loc` in `file`.
    pub fn at(file: &Path, loc: &Location, message: impl Into<String>) -> Self {
        ConfigError {
            file: file.to_path_buf(),
            line: loc.line(),
            col: loc.column(),
            message: message.into(),
        }
    }

    /// An error with no position (a missing file).
    pub fn file(file: &Path, message: impl Into<String>) -> Self {
        ConfigError {
            file: file.to_path_buf(),
            line: 0,
            col: 0,
            message: message.into(),
        }
    }
}

/// `file:line:col`, or `file` alone when the position is unknown.
struct Position<'a>(&'a ConfigError);

impl std::fmt::Display for Position<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let e = self.0;
        if e.line == 0 {
            write!(f, "{}", e.file.display())
        } else {
            write!(f, "{}:{}:{}", e.file.display(), e.line, e.col)
        }
    }
}

/// Read and parse a YAML file into `T`, mapping parse errors to `file:line:col`.
pub fn parse_file<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError::file(path, format!("cannot read: {e}")))?;
    parse_str(path, &text)
}

/// Parse YAML text (named `path` in errors).
pub fn parse_str<T: serde::de::DeserializeOwned>(path: &Path, text: &str) -> Result<T, ConfigError> {
    parse_with(path, text, serde_saphyr::Options::default(), None)
}

/// How large a file of many similar entries (API keys, rules) may be, for the YAML parser's
/// budget: `entries` of at most `nodes_per_entry` YAML nodes and `bytes_per_entry` bytes of
/// scalar text each. `what` names the setting that raises it, for the error.
#[derive(Debug, Clone, Copy)]
pub struct Sized {
    /// Entries allowed.
    pub entries: usize,
    /// YAML nodes (maps, sequences, scalars) one entry may take.
    pub nodes_per_entry: usize,
    /// Scalar bytes one entry may take.
    pub bytes_per_entry: usize,
    /// The setting that raises `entries` (`limits.max_keys`).
    pub what: &'static str,
}

/// [`parse_str`] with the parser's budgets sized for `size`: a registry of a million keys
/// parses, and alias expansion stays bounded (the alias limits are not raised).
pub fn parse_str_sized<T: serde::de::DeserializeOwned>(path: &Path, text: &str, size: Sized) -> Result<T, ConfigError> {
    let nodes = size.entries.saturating_mul(size.nodes_per_entry).saturating_add(10_000);
    let mut budget = serde_saphyr::Budget::default();
    budget.max_nodes = nodes;
    budget.max_events = nodes.saturating_mul(2);
    budget.max_total_scalar_bytes = size
        .entries
        .saturating_mul(size.bytes_per_entry)
        .saturating_add(1 << 20);
    let mut options = serde_saphyr::Options::default();
    options.budget = Some(budget);
    parse_with(path, text, options, Some(size))
}

/// Read and [`parse_str_sized`] a file.
pub fn parse_file_sized<T: serde::de::DeserializeOwned>(path: &Path, size: Sized) -> Result<T, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError::file(path, format!("cannot read: {e}")))?;
    parse_str_sized(path, &text, size)
}

fn parse_with<T: serde::de::DeserializeOwned>(
    path: &Path,
    text: &str,
    options: serde_saphyr::Options,
    size: Option<Sized>,
) -> Result<T, ConfigError> {
    serde_saphyr::from_str_with_options::<T>(text, options).map_err(|e| {
        if let (Some(size), true) = (size, e.to_string().contains("budget")) {
            // The parser's own words ("budget breached: Nodes { nodes: 250001 }") mean nothing
            // to an operator: say which setting bounds the file.
            return ConfigError::file(
                path,
                format!(
                    "the file is larger than {} allows ({} entries of at most {} YAML nodes each); raise {} in gateway.yaml",
                    size.what, size.entries, size.nodes_per_entry, size.what
                ),
            );
        }
        let (line, col) = e.location().map(|l| (l.line(), l.column())).unwrap_or((0, 0));
        let msg = e.without_snippet().to_string();
        // The rendered message may itself carry a position and a snippet: keep its first line,
        // without the position (it is printed once, in front).
        let msg = msg.lines().next().unwrap_or("invalid YAML");
        let msg = match msg.rfind(" at line ") {
            Some(i) if line != 0 => &msg[..i],
            _ => msg,
        };
        let msg = did_you_mean(msg);
        ConfigError {
            file: path.to_path_buf(),
            line,
            col,
            message: msg,
        }
    })
}

/// For "unknown field `x`, expected one of a, b, c": name the closest expected field.
fn did_you_mean(msg: &str) -> String {
    let Some(rest) = msg.strip_prefix("unknown field `") else {
        return msg.to_string();
    };
    let Some((field, rest)) = rest.split_once('`') else {
        return msg.to_string();
    };
    let Some(list) = rest
        .strip_prefix(", expected one of ")
        .or_else(|| rest.strip_prefix(", expected "))
    else {
        return msg.to_string();
    };
    let best = list
        .split(", ")
        .map(|c| c.trim_matches('`'))
        .map(|c| (edit_distance(field, c), c))
        .min();
    match best {
        Some((d, c)) if d <= 2.max(field.len() / 3) => format!("{msg}; did you mean `{c}`?"),
        _ => msg.to_string(),
    }
}

/// Levenshtein distance (field names are short).
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            cur[j + 1] = (prev[j] + usize::from(ca != *cb)).min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}

/// Parse a humantime duration held in a spanned string.
pub fn duration(file: &Path, s: &Spanned<String>) -> Result<Duration, ConfigError> {
    humantime::parse_duration(s.value.trim())
        .map_err(|e| ConfigError::at(file, &s.referenced, format!("invalid duration {:?}: {e}", s.value)))
}

/// A secret from the environment. Its `Debug` never shows it.
#[derive(Clone, Default)]
pub struct Secret(pub(crate) String);

impl Secret {
    /// The secret itself (to hand to a client library, never to a log).
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(***)")
    }
}

/// The value of the environment variable that `name` (the setting `field`) names. A variable
/// that is unset, or empty or blank, is an error naming the setting's `file:line:col`: a
/// secret that is missing must refuse to start, never silently mean "none".
pub fn required_env(file: &Path, name: &Spanned<String>, field: &str) -> Result<String, ConfigError> {
    match std::env::var(&name.value) {
        Ok(v) if !v.trim().is_empty() => Ok(v),
        Ok(_) => Err(ConfigError::at(
            file,
            &name.referenced,
            format!("{field}: the environment variable {} is empty", name.value),
        )),
        Err(_) => Err(ConfigError::at(
            file,
            &name.referenced,
            format!("{field}: the environment variable {} is not set", name.value),
        )),
    }
}
