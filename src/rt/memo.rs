//! The last value a thread made, kept and handed out again while what it was made from is
//! unchanged. Denials come in floods from one caller, and within a second each 429 says the
//! same thing: the deny path copies the last one instead of writing it again.
//!
//! A [`Memo`] lives in a `thread_local!` of its user. It is never shared between threads, and
//! a nested use (the memo already borrowed) finds nothing and keeps nothing rather than
//! panicking.

use std::cell::RefCell;

/// One kept value, or none yet.
pub struct Memo<T>(RefCell<Option<T>>);

impl<T> Memo<T> {
    /// An empty memo (usable in a `const` thread-local initialiser).
    pub const fn new() -> Self {
        Memo(RefCell::new(None))
    }

    /// `read` of the kept value when `fresh` says it is still the one wanted; `None` when
    /// nothing is kept, it is stale, or the memo is in use further up the stack.
    pub fn reuse<R>(&self, fresh: impl FnOnce(&T) -> bool, read: impl FnOnce(&T) -> R) -> Option<R> {
        let kept = self.0.try_borrow().ok()?;
        kept.as_ref().filter(|t| fresh(t)).map(read)
    }

    /// Keep what `make` builds, handing it the value kept before (whose allocations it may
    /// reuse). Does nothing while the memo is in use further up the stack.
    pub fn keep(&self, make: impl FnOnce(Option<T>) -> T) {
        if let Ok(mut kept) = self.0.try_borrow_mut() {
            let old = kept.take();
            *kept = Some(make(old));
        }
    }
}

impl<T> Default for Memo<T> {
    fn default() -> Self {
        Memo::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_value_is_handed_out_while_fresh_and_replaced_with_its_allocation_reused() {
        let m: Memo<(u64, String)> = Memo::new();
        assert_eq!(m.reuse(|_| true, |(_, s)| s.clone()), None, "nothing kept yet");
        m.keep(|_| (1, "one".to_string()));
        assert_eq!(m.reuse(|(k, _)| *k == 1, |(_, s)| s.clone()).as_deref(), Some("one"));
        assert_eq!(m.reuse(|(k, _)| *k == 2, |(_, s)| s.clone()), None, "stale");
        let before = m.reuse(|_| true, |(_, s)| s.as_ptr()).unwrap(); // allow-panic: unit test of the memo, never on the request path
        m.keep(|old| {
            let mut s = old.map(|(_, s)| s).unwrap_or_default();
            s.clear();
            s.push_str("two");
            (2, s)
        });
        assert_eq!(m.reuse(|(k, _)| *k == 2, |(_, s)| s.clone()).as_deref(), Some("two"));
        assert_eq!(
            m.reuse(|_| true, |(_, s)| s.as_ptr()),
            Some(before),
            "its buffer reused"
        );
    }

    #[test]
    fn a_nested_use_finds_nothing_and_keeps_nothing_rather_than_panicking() {
        let m: Memo<u64> = Memo::new();
        m.keep(|_| 7);
        let inner = m.reuse(
            |_| true,
            |_| {
                m.keep(|_| 8);
                m.reuse(|_| true, |v| *v)
            },
        );
        assert_eq!(inner, Some(Some(7)), "a read inside a read shares the borrow");
        m.keep(|_| {
            assert_eq!(m.reuse(|_| true, |v| *v), None, "busy while it is being replaced");
            9
        });
        assert_eq!(m.reuse(|_| true, |v| *v), Some(9));
    }
}
