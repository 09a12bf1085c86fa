//! Work that must never compete with requests for a CPU: config reloads and the freeing of
//! large snapshots.
//!
//! A reload of a million-key registry keeps a core busy for seconds. On a blocking-pool thread
//! at normal priority that core is taken from the runtime's workers (and from the upstream and
//! clients sharing the machine), and request latency rises for the whole reload. Here each job
//! gets its own short-lived thread at the lowest normal priority (`SCHED_BATCH`, nice 19 on
//! Linux), so the scheduler runs it only in the time the request path leaves over: a reload
//! under load takes longer, and requests do not notice it. Reloads are rare, so a thread per
//! job costs nothing that matters and never takes a blocking-pool thread away from others.

use std::sync::Arc;
use std::time::{Duration, Instant};

use thread_priority::{
    set_thread_priority_and_policy, thread_native_id, NormalThreadSchedulePolicy, ThreadPriority, ThreadSchedulePolicy,
};

/// Why a background job gave no result.
#[derive(Debug, thiserror::Error)]
pub enum BackgroundError {
    /// The thread could not be started.
    #[error("cannot start a background thread: {0}")]
    Spawn(#[from] std::io::Error),
    /// The job panicked.
    #[error("the background job `{0}` failed")]
    Failed(&'static str),
}

/// Lower the calling thread to the lowest normal priority. Best effort: where the platform
/// refuses, the job runs at normal priority (and says so at debug level).
fn lower_priority() {
    let policy = ThreadSchedulePolicy::Normal(NormalThreadSchedulePolicy::Batch);
    if let Err(e) = set_thread_priority_and_policy(thread_native_id(), ThreadPriority::Min, policy) {
        tracing::debug!(error = ?e, "cannot lower the background thread's priority");
    }
}

/// Run `job` on a new thread named `name` at the lowest priority and wait for its result
/// without blocking the runtime.
pub async fn run<T, F>(name: &'static str, job: F) -> Result<T, BackgroundError>
where
    T: Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name(format!("tollgate-{name}"))
        .spawn(move || {
            lower_priority();
            let _ = tx.send(job());
        })?;
    rx.await.map_err(|_| BackgroundError::Failed(name))
}

/// How long [`reclaim`] waits for the last reader of a replaced value before leaving the
/// freeing to that reader.
const RECLAIM_WAIT: Duration = Duration::from_secs(30);

/// Free `value` on a low-priority thread once nobody else holds it.
///
/// A request that loaded the old snapshot just before a swap may still hold it; if that request
/// dropped the last reference, it would free a whole registry on a runtime worker. So this
/// thread waits (polling every 10 ms, up to 30 s) until it holds the only reference, then frees
/// it. A reader that holds on longer frees it itself.
pub fn reclaim<T: Send + Sync + 'static>(value: Arc<T>) {
    let spawned = std::thread::Builder::new()
        .name("tollgate-reclaim".into())
        .spawn(move || {
            lower_priority();
            let deadline = Instant::now() + RECLAIM_WAIT;
            while Arc::strong_count(&value) > 1 && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            drop(value);
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot start a thread to free a replaced snapshot; freeing it here");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The nice value of the calling thread, from procfs.
    #[cfg(target_os = "linux")]
    fn own_nice() -> i64 {
        let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap_or_default();
        // Fields after the command name (which ends with ')'): state is field 3, nice field 19.
        let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
        rest.split_whitespace()
            .nth(16)
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    }

    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn jobs_run_at_the_lowest_priority_and_return_their_result() {
        let before = own_nice();
        let (nice, answer) = run("test", || (own_nice(), 6 * 7)).await.unwrap(); // allow-panic: test
        assert_eq!(answer, 42);
        assert_eq!(nice, 19, "the job ran at nice {nice}");
        assert_eq!(own_nice(), before, "the caller's priority must not change");
    }

    #[tokio::test]
    async fn a_panicking_job_is_an_error_not_a_crash() {
        let r: Result<(), _> = run("test", || panic!("boom")).await; // allow-panic: test
        assert!(matches!(r, Err(BackgroundError::Failed("test"))));
    }

    #[test]
    fn the_reclaim_thread_frees_the_value_after_the_last_reader_lets_go() {
        /// Records the name of the thread that dropped it.
        struct Witness(Arc<std::sync::Mutex<Option<String>>>);
        impl Drop for Witness {
            fn drop(&mut self) {
                let name = std::thread::current().name().map(str::to_owned);
                if let Ok(mut w) = self.0.lock() {
                    *w = name;
                }
            }
        }
        let freed_by = Arc::new(std::sync::Mutex::new(None));
        let value = Arc::new(Witness(freed_by.clone()));
        let reader = value.clone();
        reclaim(value);
        drop(reader); // a request letting go of the old snapshot: it must not free it
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut by = None;
        while by.is_none() && Instant::now() < deadline {
            std::thread::yield_now();
            by = freed_by.lock().ok().and_then(|w| w.clone());
        }
        assert_eq!(by.as_deref(), Some("tollgate-reclaim"));
    }
}
