//! Live reload of the rules and keys files.
//!
//! Three triggers: a file-system watcher on the files' parent directories (so editor atomic
//! renames and Kubernetes `..data` symlink swaps are seen), `SIGHUP`, and `POST /reload`. A
//! polling fallback compares the files' content fingerprint every 250 ms, so a change is live
//! within 1 s even where notifications are lost (network file systems, some container mounts).
//! Every trigger parses and validates first, then swaps one `ArcSwap` snapshot; a broken file
//! is refused, logged and counted, and the old rules stay. Counters live in the store, keyed by
//! rule name, so they survive reloads.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};
use tokio::sync::{mpsc, watch};

use crate::gateway::Gateway;

/// A fingerprint of the watched files' current content (missing files count as empty).
fn fingerprint(files: &[PathBuf]) -> [u8; 32] {
    let mut h = Sha256::new();
    for f in files {
        match std::fs::read(f) {
            Ok(b) => h.update(&b),
            Err(_) => h.update(b"\0missing\0"),
        }
        h.update([0xff]);
    }
    h.finalize().into()
}

/// Start the watcher, the poller and the SIGHUP handler. They stop when `stop` flips.
pub fn spawn_watcher(gw: Arc<Gateway>, mut stop: watch::Receiver<bool>) {
    let mut files = vec![gw.config.rules_file.clone()];
    if let Some(k) = &gw.config.keys_file {
        files.push(k.clone());
    }
    // The gateway file is watched too, not to apply it (that needs a restart) but to say that
    // the running config no longer matches it (`Gateway::check_config_file`).
    files.push(gw.config.path.clone());
    let (tx, mut rx) = mpsc::channel::<&'static str>(4);

    // File-system notifications: watch each parent directory, not the file itself.
    let ntx = tx.clone();
    let watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
        // Reads (including this module's own polling) are not changes.
        if res.is_ok_and(|ev| !matches!(ev.kind, notify::EventKind::Access(_))) {
            let _ = ntx.try_send("file change");
        }
    });
    let watcher = match watcher {
        Ok(mut w) => {
            use notify::Watcher;
            let mut dirs: Vec<PathBuf> = files
                .iter()
                .map(|f| {
                    f.parent()
                        .map(|p| p.to_path_buf())
                        .unwrap_or_else(|| PathBuf::from("."))
                })
                .collect();
            dirs.sort();
            dirs.dedup();
            for d in &dirs {
                let d = if d.as_os_str().is_empty() {
                    PathBuf::from(".")
                } else {
                    d.clone()
                };
                if let Err(e) = w.watch(&d, notify::RecursiveMode::NonRecursive) {
                    tracing::warn!(dir = %d.display(), error = %e, "cannot watch directory; polling only");
                }
            }
            Some(w)
        }
        Err(e) => {
            tracing::warn!(error = %e, "file watcher unavailable; polling only");
            None
        }
    };

    #[cfg(unix)]
    {
        let stx = tx.clone();
        tokio::spawn(async move {
            use tokio::signal::unix::{signal, SignalKind};
            let Ok(mut hup) = signal(SignalKind::hangup()) else {
                return;
            };
            while hup.recv().await.is_some() {
                let _ = stx.send("SIGHUP").await;
            }
        });
    }

    tokio::spawn(async move {
        let _watcher = watcher; // dropped (and unwatched) when this task ends
        let mut last = fingerprint(&files);
        let mut poll = tokio::time::interval(Duration::from_millis(250));
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let forced = tokio::select! {
                _ = stop.changed() => return,
                _ = poll.tick() => None,
                t = rx.recv() => t,
            };
            let mut sighup = forced == Some("SIGHUP");
            if forced.is_some() {
                // Let an editor or kubelet finish its rename/swap, then take every queued
                // trigger at once (remembering whether one was SIGHUP).
                tokio::time::sleep(Duration::from_millis(50)).await;
                while let Ok(t) = rx.try_recv() {
                    sighup |= t == "SIGHUP";
                }
            }
            let now = fingerprint(&files);
            // SIGHUP reloads even when nothing changed: the operator asked for it.
            if now == last && !sighup {
                continue;
            }
            last = now;
            let why = if sighup { "SIGHUP" } else { forced.unwrap_or("poll") };
            let _ = gw.reload(why).await;
        }
    });
}
