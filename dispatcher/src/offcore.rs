//! Work handed off the core thread: the core copies what a slow consumer
//! needs (plain numbers, names in one buffer) and hands the copy to one
//! worker thread, which does the slow part (assembling the web snapshot,
//! setting thousands of Prometheus series) while the core goes on.
//!
//! Only the newest copy matters: a copy the worker has not taken yet is
//! replaced by the next one (and dropped by the core after the lock), so
//! a slow worker never builds a queue behind the core. The worker starts
//! with the first hand-off, so a consumer that is never fed costs no
//! thread.

use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};

/// What the worker thread runs on each value.
type Work<T> = Box<dyn FnMut(T) + Send>;

/// A one-slot hand-off from the core to a named worker thread.
pub struct Handoff<T> {
    shared: Arc<Shared<T>>,
    name: &'static str,
    /// The worker's body until the worker starts.
    work: Mutex<Option<Work<T>>>,
    started: OnceLock<()>,
}

struct Shared<T> {
    slot: Mutex<Slot<T>>,
    changed: Condvar,
}

struct Slot<T> {
    next: Option<T>,
    /// Values handed over, and of those taken and processed (or replaced).
    handed: u64,
    done: u64,
    stop: bool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl<T: Send + 'static> Handoff<T> {
    /// A hand-off whose worker thread, named `name`, runs `work` on each
    /// value it takes.
    pub fn new(name: &'static str, work: impl FnMut(T) + Send + 'static) -> Self {
        Self {
            shared: Arc::new(Shared {
                slot: Mutex::new(Slot {
                    next: None,
                    handed: 0,
                    done: 0,
                    stop: false,
                }),
                changed: Condvar::new(),
            }),
            name,
            work: Mutex::new(Some(Box::new(work))),
            started: OnceLock::new(),
        }
    }

    /// Hand `value` to the worker, replacing a value it has not taken yet;
    /// starts the worker the first time.
    pub fn hand(&self, value: T) {
        let replaced = {
            let mut slot = lock(&self.shared.slot);
            slot.handed += 1;
            slot.next.replace(value)
        };
        self.shared.changed.notify_all();
        self.started.get_or_init(|| self.start());
        // A value the worker had not taken is dropped here, after the lock.
        drop(replaced);
    }

    fn start(&self) {
        let Some(mut work) = lock(&self.work).take() else {
            return;
        };
        let shared = self.shared.clone();
        let started = std::thread::Builder::new()
            .name(self.name.into())
            .spawn(move || {
                while let Some((value, number)) = shared.take() {
                    work(value);
                    lock(&shared.slot).done = number;
                    shared.changed.notify_all();
                }
            });
        if let Err(err) = started {
            tracing::error!(%err, thread = self.name, "cannot start a worker thread: its work is not done");
            lock(&self.shared.slot).stop = true;
            self.shared.changed.notify_all();
        }
    }

    /// Wait until every value handed over so far is processed or replaced
    /// (tests, and callers that need the effect now).
    pub fn wait_done(&self) {
        let mut slot = lock(&self.shared.slot);
        while slot.done < slot.handed && !slot.stop {
            slot = self
                .shared
                .changed
                .wait(slot)
                .unwrap_or_else(|e| e.into_inner());
        }
    }
}

impl<T> Shared<T> {
    /// The next value and its number, or `None` once stopped.
    fn take(&self) -> Option<(T, u64)> {
        let mut slot = lock(&self.slot);
        loop {
            if slot.stop {
                return None;
            }
            if let Some(value) = slot.next.take() {
                return Some((value, slot.handed));
            }
            slot = self.changed.wait(slot).unwrap_or_else(|e| e.into_inner());
        }
    }
}

impl<T> Drop for Handoff<T> {
    fn drop(&mut self) {
        lock(&self.shared.slot).stop = true;
        self.shared.changed.notify_all();
    }
}

/// Where a string sits in a [`Names`] buffer.
pub type Span = (u32, u32);

/// Strings copied end to end into one buffer (one allocation for all the
/// names of a copy, not one per name), each found again by its [`Span`].
#[derive(Debug, Default)]
pub struct Names {
    text: String,
}

impl Names {
    /// An empty buffer with room for `bytes`.
    pub fn with_capacity(bytes: usize) -> Self {
        Self {
            text: String::with_capacity(bytes),
        }
    }

    /// Append `parts` as one string; its span.
    pub fn push(&mut self, parts: &[&str]) -> Span {
        let start = self.text.len() as u32;
        for p in parts {
            self.text.push_str(p);
        }
        (start, self.text.len() as u32)
    }

    /// The string at `span`.
    pub fn get(&self, span: Span) -> &str {
        &self.text[span.0 as usize..span.1 as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;

    #[test]
    fn the_worker_processes_the_newest_value_and_waiting_sees_it_done() {
        let (tx, rx) = mpsc::channel();
        let h = Handoff::new("test-handoff", move |v: u32| {
            tx.send(v).unwrap();
        });
        h.hand(1);
        h.wait_done();
        assert_eq!(rx.try_recv(), Ok(1));
        for v in 2..=50 {
            h.hand(v);
        }
        h.wait_done();
        let seen: Vec<u32> = rx.try_iter().collect();
        // Values may be replaced before the worker takes them, but the
        // last one is always processed, in order.
        assert_eq!(seen.last(), Some(&50), "{seen:?}");
        assert!(seen.windows(2).all(|w| w[0] < w[1]), "{seen:?}");
    }

    #[test]
    fn names_come_back_by_their_spans() {
        let mut n = Names::with_capacity(4);
        let a = n.push(&["node-1"]);
        let b = n.push(&[]);
        let c = n.push(&["z1", "/", "r2"]);
        assert_eq!((n.get(a), n.get(b), n.get(c)), ("node-1", "", "z1/r2"));
    }

    #[test]
    fn nothing_handed_starts_no_worker_and_waiting_returns() {
        let h = Handoff::new("test-handoff", |_: u32| panic!("no value was handed"));
        h.wait_done();
        assert!(h.started.get().is_none());
    }
}
