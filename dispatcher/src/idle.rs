//! What the dispatcher's long-lived threads do as they go idle: a hook
//! the binary sets once (the release dispatcher: its allocator collects
//! the thread's heap, `src/bin/dispatcher.rs`), called by the core's
//! thread before it waits for commands and by the store's after each
//! commit. Unset (tests, other embedders) it costs an atomic load.
//!
//! Why: mimalloc gives a page of small blocks back only once its owner
//! thread has taken back the blocks other threads freed into it, which
//! the owner does when it allocates there again or collects. The core
//! frees what the async workers decoded (a relayed node's Register and
//! first LoadReport), the workers free what the core sent; a thread that
//! goes quiet after a burst (a relay attaching thousands of nodes) left
//! those pages resident, ~0.3 KB per relayed node
//! (docs/BENCHMARKS.md, section "mem3").

use std::sync::OnceLock;

static HOOK: OnceLock<fn()> = OnceLock::new();

/// Set the hook (once; a later call is ignored and returns false).
pub fn set_hook(hook: fn()) -> bool {
    HOOK.set(hook).is_ok()
}

/// This thread is about to wait: run the hook, if one is set.
pub fn idle() {
    if let Some(hook) = HOOK.get() {
        hook();
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    thread_local! {
        /// Calls on this thread (the other tests' core threads call the
        /// hook too, once it is set for the test process).
        static CALLS: Cell<usize> = const { Cell::new(0) };
    }

    fn count() {
        CALLS.set(CALLS.get() + 1);
    }

    /// The hook runs on every idle call once set, and is set once only.
    #[test]
    fn the_hook_runs_once_set_and_is_set_once() {
        assert!(super::set_hook(count));
        assert!(!super::set_hook(|| panic!("a second hook")));
        super::idle();
        super::idle();
        assert_eq!(CALLS.get(), 2);
    }
}
