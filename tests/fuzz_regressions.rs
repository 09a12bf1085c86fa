//! Replays the fuzz corpus that matters through the same checks the fuzz targets run
//! (`fuzz/src/lib.rs`, included here): every crash input kept in `fuzz/regressions/<target>/`
//! and the hand-written seeds in `fuzz/seeds/<target>/`. A fixed crash stays fixed without
//! `cargo fuzz` installed.

#[path = "../fuzz/src/lib.rs"]
mod checks;

use std::path::Path;

/// Run `check` on every file under `fuzz/{regressions,seeds}/<target>/`; returns how many.
fn replay(target: &str, check: fn(&[u8])) -> usize {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let mut n = 0;
    for dir in ["regressions", "seeds"] {
        let Ok(entries) = std::fs::read_dir(root.join(dir).join(target)) else {
            continue;
        };
        let mut files: Vec<_> = entries
            .filter_map(|e| e.ok())
            .map(|e| e.path())
            .filter(|p| p.is_file())
            .collect();
        files.sort();
        for f in files {
            let data = std::fs::read(&f).unwrap();
            let r = std::panic::catch_unwind(|| check(&data));
            assert!(r.is_ok(), "{target}: {} fails its check", f.display());
            n += 1;
        }
    }
    n
}

#[test]
fn config_inputs() {
    assert!(replay("config", checks::config) > 0);
}

#[test]
fn path_inputs() {
    assert!(replay("path", checks::path) > 0);
}

#[test]
fn identity_inputs() {
    assert!(replay("identity", checks::identity) > 0);
}

#[test]
fn jwt_inputs() {
    assert!(replay("jwt", checks::jwt) > 0);
}
