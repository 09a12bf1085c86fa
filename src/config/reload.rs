//! Live reload of the rules and keys files (and the JWT key files).
//!
//! Three triggers: a file-system watcher on the files' parent directories (so editor atomic
//! renames and Kubernetes `..data` symlink swaps are seen), `SIGHUP`, and `POST /reload`. A
//! polling fallback compares the files' content fingerprint every 250 ms, so a change is live
//! within 1 s even where notifications are lost (network file systems, some container mounts).
//! Every trigger parses and validates first, then swaps one `ArcSwap` snapshot; a broken file
//! is refused, logged and counted, and the old rules stay. Counters live in the store, keyed by
//! rule name, so they survive reloads.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use sha2::{Digest, Sha256};
use tokio::sync::{mpsc, watch};

/// What asked for a reload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trigger {
    /// A file-system notification on a watched file's directory.
    FileChange,
    /// The polling fallback saw a watched file change.
    Poll,
    /// `SIGHUP`: reload even if nothing changed, the operator asked for it.
    Signal,
    /// `POST /reload` on the admin port.
    Admin,
}

impl Trigger {
    /// The name in logs and reload reports.
    pub fn as_str(self) -> &'static str {
        match self {
            Trigger::FileChange => "file change",
            Trigger::Poll => "poll",
            Trigger::Signal => "SIGHUP",
            Trigger::Admin => "admin",
        }
    }
}

/// How often the polling fallback looks at the files.
const POLL_EVERY: Duration = Duration::from_millis(250);

/// How long to let an editor or kubelet finish its rename or symlink swap after a notification
/// before reading the files.
const SETTLE: Duration = Duration::from_millis(50);

/// What a file looked like: its metadata, and a digest of its content read only when the
/// metadata moved (so a poll of an unchanged file reads no content).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
struct Seen {
    /// (modified, length, inode) of each file; `None` for a missing one.
    stats: Vec<Option<(SystemTime, u64, u64)>>,
    /// SHA-256 over every file's content.
    digest: [u8; 32],
}

/// Look at `files`, reading their content only when their metadata differs from `last`.
/// Blocking file I/O: run it on a blocking thread.
fn look(files: &[PathBuf], last: &Seen) -> Seen {
    let stats: Vec<_> = files.iter().map(|f| stat(f)).collect();
    if !last.stats.is_empty() && stats == last.stats {
        return last.clone();
    }
    let mut h = Sha256::new();
    for f in files {
        // Streamed: a 120 MB registry is never held in memory just to be hashed.
        let read = std::fs::File::open(f).and_then(|mut file| std::io::copy(&mut file, &mut h));
        if read.is_err() {
            h.update(b"\0missing\0");
        }
        h.update([0xff]);
    }
    Seen {
        stats,
        digest: h.finalize().into(),
    }
}

/// (modified, length, inode) of `f`, following symlinks (a Kubernetes `..data` swap changes
/// the inode even when the time and size do not).
fn stat(f: &Path) -> Option<(SystemTime, u64, u64)> {
    let m = std::fs::metadata(f).ok()?;
    #[cfg(unix)]
    let ino = std::os::unix::fs::MetadataExt::ino(&m);
    #[cfg(not(unix))]
    let ino = 0;
    Some((m.modified().ok()?, m.len(), ino))
}

/// `look` off the runtime: on a blocking thread while only metadata is read, and on a
/// low-priority thread when a changed file must be hashed, so a large file never takes CPU from
/// the requests.
async fn look_off_runtime(files: &[PathBuf], last: &Seen) -> Seen {
    let (f, l) = (files.to_vec(), last.clone());
    let stats_only = tokio::task::spawn_blocking(move || {
        let stats: Vec<_> = f.iter().map(|f| stat(f)).collect();
        (!l.stats.is_empty() && stats == l.stats).then_some(l)
    })
    .await;
    if let Ok(Some(same)) = stats_only {
        return same;
    }
    let (f, l) = (files.to_vec(), last.clone());
    crate::background::run("look", move || look(&f, &l))
        .await
        .unwrap_or_else(|_| last.clone())
}

/// Watch `files` (the rules file, the keys file, the gateway file) and call `on_change` with
/// what triggered, whenever their content changed, or on `SIGHUP` whatever it is. The watcher,
/// the poller and the signal handler stop when `stop` flips.
pub fn spawn_watcher<F, Fut>(files: Vec<PathBuf>, mut stop: watch::Receiver<bool>, on_change: F)
where
    F: Fn(Trigger) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    let (tx, mut rx) = mpsc::channel::<Trigger>(4);
    // The files as they are now, read before this returns (once, at start-up), so a change made
    // right after start is never taken for the starting state.
    let first = look(&files, &Seen::default());

    // File-system notifications: watch each parent directory, not the file itself.
    let ntx = tx.clone();
    let watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
        // Reads (including this module's own polling) are not changes.
        if res.is_ok_and(|ev| !matches!(ev.kind, notify::EventKind::Access(_))) {
            let _ = ntx.try_send(Trigger::FileChange);
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
                let _ = stx.send(Trigger::Signal).await;
            }
        });
    }

    tokio::spawn(async move {
        let _watcher = watcher; // dropped (and unwatched) when this task ends
        let mut last = first;
        let mut poll = tokio::time::interval(POLL_EVERY);
        poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let forced = tokio::select! {
                _ = stop.changed() => return,
                _ = poll.tick() => None,
                t = rx.recv() => t,
            };
            let mut signal = forced == Some(Trigger::Signal);
            if forced.is_some() {
                // Let an editor or kubelet finish its rename/swap, then take every queued
                // trigger at once (remembering whether one was SIGHUP).
                tokio::time::sleep(SETTLE).await;
                while let Ok(t) = rx.try_recv() {
                    signal |= t == Trigger::Signal;
                }
            }
            let now = look_off_runtime(&files, &last).await;
            // SIGHUP reloads even when nothing changed: the operator asked for it.
            if now.digest == last.digest && !signal {
                last = now;
                continue;
            }
            last = now;
            let why = if signal {
                Trigger::Signal
            } else {
                forced.unwrap_or(Trigger::Poll)
            };
            on_change(why).await;
        }
    });
}
