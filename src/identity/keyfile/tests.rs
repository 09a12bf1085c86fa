//! The fast `keys.yaml` reader against the YAML parser: for every file, the same registry or the
//! same error (message and `line:col`), and the fast reader takes the layouts it is meant for.

use std::path::Path;

use super::{scan, Scan};
use crate::identity::keys::{hash_key, KeyEntry, KeyRegistry};
use crate::identity::raw::RawKeys;
use crate::yaml::{parse_str_sized, ConfigError, Sized};

type Loaded = Result<Vec<([u8; 32], KeyEntry)>, String>;

fn sorted(r: Result<KeyRegistry, ConfigError>) -> Loaded {
    r.map(|reg| {
        let mut v: Vec<_> = reg.entries().map(|(h, e)| (*h, e.clone())).collect();
        v.sort_by_key(|a| a.0);
        v
    })
    .map_err(|e| e.to_string())
}

/// The registry as the YAML parser alone makes it (the code path before the fast reader).
fn by_parser(path: &Path, text: &str, max: usize) -> Loaded {
    let size = Sized {
        entries: max,
        nodes_per_entry: 12,
        bytes_per_entry: 512,
        what: "limits.max_keys",
    };
    sorted(parse_str_sized::<RawKeys>(path, text, size).and_then(|raw| {
        if raw.keys.len() > max {
            return Err(ConfigError::file(
                path,
                format!(
                    "{} keys is over limits.max_keys ({max}); raise it in gateway.yaml",
                    raw.keys.len()
                ),
            ));
        }
        KeyRegistry::compile(path, raw)
    }))
}

/// True when the fast reader takes `text` (rather than leaving it to the parser).
fn fast_takes(text: &str, max: usize) -> bool {
    matches!(scan(text.as_bytes(), max, |_| Ok::<(), ()>(())), Scan::Read { .. })
}

/// Load `text` both ways; they must agree. Returns the result and whether the fast reader took it.
fn both(text: &str, max: usize) -> (Loaded, bool) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("keys.yaml");
    std::fs::write(&path, text).unwrap();
    let loaded = sorted(KeyRegistry::load_max(&path, max));
    let parsed = by_parser(&path, text, max);
    assert_eq!(loaded, parsed, "the fast reader and the parser disagree on {text:?}");
    (loaded, fast_takes(text, max))
}

fn h(n: u32) -> String {
    hash_key(&format!("key-{n}"))
}

#[test]
fn the_generated_layouts_are_read_fast_and_mean_what_yaml_says() {
    let (a, b, c) = (h(1), h(2), h(3));
    let files = [
        format!("keys:\n  - {{ id: cust_1, sha256: {a}, tier: pro, org: acme }}\n  - {{ id: cust_2, sha256: {b} }}\n"),
        format!("# a comment\n\nkeys: # the registry\n- {{id: 1e5, sha256: {a},tier: true}}\n-   {{ id: \"x y\" , sha256: '{b}' , org: 'a#b' }}   # trailing\n"),
        format!("keys:\n  - id: cust_1\n    sha256: {a}\n    tier: pro\n\n    # between\n    org: acme # org\n  -   id: 0x1F\n      sha256: \"{b}\"\n  - {{ id: z@y.example, sha256: {c}, tier: a-b_c.d/e+f=g }}\n"),
        format!("keys:\r\n  - {{ id: crlf, sha256: {a} }}\r\n  # Schlüssel — ünïcödé in a comment\r\n  - {{ id: '', sha256: {b} }}\r\n"),
    ];
    for f in &files {
        let (_, fast) = both(f, 1000);
        assert!(fast, "the fast reader should take {f:?}");
    }
    let (loaded, _) = both(&files[0], 1000);
    let entries = loaded.unwrap();
    assert_eq!(entries.len(), 2);
    let one = entries.iter().find(|(_, e)| &*e.id == "cust_1").unwrap();
    assert_eq!((&*one.1.tier, one.1.org.as_deref()), ("pro", Some("acme")));
    let two = entries.iter().find(|(_, e)| &*e.id == "cust_2").unwrap();
    assert_eq!((&*two.1.tier, two.1.org.as_deref()), (crate::identity::ANONYMOUS, None));
}

#[test]
fn a_bad_entry_gets_the_parsers_error_and_position_from_the_fast_reader() {
    let (a, b) = (h(1), h(2));
    let cases = [
        (
            format!("keys:\n  - {{ id: k1, sha256: {a} }}\n  - {{ id: k2, sha256: abc }}\n"),
            "keys.yaml:3:23: sha256 must be 64 hex digits",
        ),
        (
            format!("keys:\n  - {{ id: k1, sha256: {a} }}\n  - {{ id: k1, sha256: {b} }}\n"),
            "keys.yaml:3:11: duplicate or empty key id \"k1\"",
        ),
        (
            format!("keys:\n  - {{ id: k1, sha256: {a} }}\n  - {{ id: k2, sha256: {a} }}\n"),
            "keys.yaml:3:23: the same key hash is registered twice",
        ),
        (
            format!("keys:\n  - id: k1\n    sha256: {a}\n  - id: ''\n    sha256: {b}\n"),
            "keys.yaml:4:9: duplicate or empty key id \"\"",
        ),
        (
            format!("keys:\n  - id: k1\n    sha256: \" {a}x\"\n"),
            "keys.yaml:3:13: sha256 must be 64 hex digits",
        ),
    ];
    for (text, want) in &cases {
        let (loaded, fast) = both(text, 1000);
        assert!(fast, "the fast reader should take {text:?}");
        let err = loaded.unwrap_err();
        assert!(err.contains(want), "{err} (want {want})");
    }
}

#[test]
fn anything_else_is_left_to_the_parser() {
    let (a, b) = (h(1), h(2));
    let other = [
        String::new(),
        "# only a comment\n".to_string(),
        "keys:\n".to_string(),
        "keys: []\n".to_string(),
        format!("\u{feff}keys:\n  - {{ id: k, sha256: {a} }}\n"),
        format!("---\nkeys:\n  - {{ id: k, sha256: {a} }}\n"),
        format!("keys:\n  - {{ id: k, sha256: {a}, tier: null }}\n"),
        format!("keys:\n  - {{ id: k, sha256: {a}, tier: ~ }}\n"),
        format!("keys:\n  - {{ id: k, sha256: {a}, tier: }}\n"),
        format!("keys:\n  - {{ id: k,\tsha256: {a} }}\n"),
        format!("keys:\n  - {{ id: \"k\\t\", sha256: {a} }}\n"),
        format!("keys:\n  - {{ id: 'it''s', sha256: {a} }}\n"),
        format!("keys:\n  - {{ id: &x k, sha256: {a} }}\n"),
        format!("keys:\n  - {{ id: !!str k, sha256: {a} }}\n"),
        format!("keys:\n  - {{ id: k, sha256: {a}, teir: pro }}\n"),
        format!("keys:\n  - {{ id: k, sha: {a} }}\n"),
        "keys:\n  - { id: k }\n".to_string(),
        format!("keys:\n  - {{ id: k, id: j, sha256: {a} }}\n"),
        format!("keys:\n  - {{ id: k, sha256: {a}, }}\n"),
        format!("keys:\n  - {{ id: a:b, sha256: {a} }}\n"),
        format!("keys:\n  - {{ id: a#b, sha256: {a} }}\n"),
        format!("keys:\n  - {{ id: a b, sha256: {a} }}\n"),
        format!("keys:\n  - {{ id: k, sha256: {a} }}#c\n"),
        format!("keys:\n  - {{ id: \"Müller\", sha256: {a} }}\n"),
        format!("keys:\n  - {{ id: k,\n      sha256: {a} }}\n"),
        format!("keys:\n  - {{ id: k, sha256: {a} }}\n - {{ id: j, sha256: {b} }}\n"),
        format!("keys:\n  - id: k\n      sha256: {a}\n"),
        format!("keys:\n  - id: k\n    id: j\n    sha256: {a}\n"),
        format!("keys:\n  - id:\n      k\n    sha256: {a}\n"),
        format!("keys:\n  - {{ id: k, sha256: {a} }}\nkeys:\n  - {{ id: j, sha256: {b} }}\n"),
        format!("keys:\n  - {{ id: k, sha256: {a} }}\nother: 1\n"),
        format!("keys:\n  - {{ id: k, sha256: {a} }}\n  - [oops\n"),
        format!("keys:\n  - {{ id: {}, sha256: {a} }}\n", "x".repeat(500)),
        // A bad hash, then a syntax error further down: the parser's syntax error wins.
        format!("keys:\n  - {{ id: k, sha256: nothex }}\n  - {{ id: j, sha256: {b}\n"),
    ];
    for text in &other {
        let (_, fast) = both(text, 1000);
        assert!(!fast, "the fast reader should leave {text:?} to the parser");
    }
}

#[test]
fn more_keys_than_the_limit_get_the_parsers_words() {
    let text: String = std::iter::once("keys:\n".to_string())
        .chain((0..50).map(|i| format!("  - {{ id: k{i}, sha256: {} }}\n", h(i))))
        .collect();
    let (loaded, fast) = both(&text, 49);
    assert!(!fast);
    assert!(loaded.unwrap_err().contains("50 keys is over limits.max_keys (49)"));
    let (loaded, fast) = both(&text, 50);
    assert!(fast);
    assert_eq!(loaded.unwrap().len(), 50);
}

/// Files built from a few tokens that are tricky for YAML, in both layouts: the fast reader and
/// the parser agree on every one, and the fast reader takes some of them.
#[test]
fn the_fast_reader_agrees_with_the_parser_on_generated_files() {
    use proptest::prelude::*;
    const VALUES: &[&str] = &[
        "k",
        "k2",
        "a.b",
        "x_y",
        "A1",
        "v/1",
        "'q'",
        "\"d\"",
        "cust_1",
        "1e5",
        "0x1F",
        "true",
        "null",
        "~",
        "''",
        "\"\"",
        "'a b'",
        "\"a#b\"",
        "a#b",
        "a:b",
        "-x",
        "x-",
        "@x",
        "x@y",
        ".inf",
        "'it''s'",
        "\"q\\\"\"",
        "a b",
        "&a x",
        "*a",
        "!t x",
        "[x]",
        "{x: 1}",
        "|",
        ">",
        "\"Ü\"",
        "%x",
        "`x",
        "x,y",
    ];
    const GAPS: &[&str] = &["", " ", " ", "  ", "\t"];
    const ENDS: &[&str] = &["", "", " ", " # c", "#c", "\r", " #Ü"];
    let hashes = [h(1), h(2), "abc".to_string(), format!("'{}'", h(3))];
    let mut runner = proptest::test_runner::TestRunner::new(proptest::test_runner::Config::with_cases(400));
    let entry = (
        0..VALUES.len(),
        0..hashes.len(),
        proptest::option::of(0..VALUES.len()),
        0..GAPS.len(),
        0..ENDS.len(),
        any::<bool>(),
    );
    let fast_count = std::cell::Cell::new(0usize);
    runner
        .run(&proptest::collection::vec(entry, 1..4), |entries| {
            let mut text = String::from("keys:\n");
            for (id, sha, tier, gap, end, block) in entries {
                let (id, sha, gap, end) = (VALUES[id], &hashes[sha], GAPS[gap], ENDS[end]);
                if block {
                    text.push_str(&format!("  - id:{gap} {id}{end}\n    sha256: {sha}\n"));
                    if let Some(t) = tier {
                        text.push_str(&format!("    tier: {}\n", VALUES[t]));
                    }
                } else {
                    let tier = tier.map(|t| format!(",{gap}tier: {}", VALUES[t])).unwrap_or_default();
                    text.push_str(&format!("  - {{{gap}id: {id}, sha256: {sha}{tier} }}{end}\n"));
                }
            }
            let (_, fast) = both(&text, 1000);
            fast_count.set(fast_count.get() + usize::from(fast));
            Ok(())
        })
        .unwrap();
    let fast_count = fast_count.get();
    // About one in twelve files is all simple tokens (34 in one run); 15 is far below that.
    assert!(fast_count >= 15, "the fast reader took only {fast_count} of 400 files");
}

#[test]
fn a_reload_counts_keys_added_removed_and_changed() {
    let dir = tempfile::tempdir().unwrap();
    let load = |text: String| {
        let path = dir.path().join("keys.yaml");
        std::fs::write(&path, text).unwrap();
        KeyRegistry::load(&path).unwrap()
    };
    let old = load(format!(
        "keys:\n  - {{ id: k1, sha256: {} }}\n  - {{ id: k2, sha256: {}, tier: pro }}\n  - {{ id: k3, sha256: {}, tier: pro }}\n",
        h(1),
        h(2),
        h(3)
    ));
    let new = load(format!(
        "keys:\n  - {{ id: k2, sha256: {}, tier: pro }}\n  - {{ id: k3, sha256: {}, tier: free }}\n  - {{ id: k4, sha256: {} }}\n",
        h(2),
        h(3),
        h(4)
    ));
    assert_eq!(new.diff(&old), (1, 1, 1), "k4 added, k1 removed, k3 changed");
    assert_eq!(old.diff(&old), (0, 0, 0));
}
