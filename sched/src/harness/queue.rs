//! The harness's timed event queue, generic over the event payload: a
//! min-heap ordered by (time, sequence number), so events at the same time
//! come out in the order they were pushed and a run is a pure function of
//! its inputs. [`super::Harness`] drives the engine's task events with it;
//! the cluster simulator (`sim` crate) drives job arrivals, completions and
//! ticks with the same queue and [`drive`] loop.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

/// A payload at a time; ordered by (time, seq) as a min-heap.
#[derive(Clone, Debug)]
struct Timed<K> {
    time: u64,
    seq: u64,
    kind: K,
}

impl<K> PartialEq for Timed<K> {
    fn eq(&self, other: &Self) -> bool {
        (self.time, self.seq) == (other.time, other.seq)
    }
}

impl<K> Eq for Timed<K> {}

impl<K> Ord for Timed<K> {
    fn cmp(&self, other: &Self) -> Ordering {
        // Reversed: BinaryHeap is a max-heap, the earliest event must win.
        (other.time, other.seq).cmp(&(self.time, self.seq))
    }
}

impl<K> PartialOrd for Timed<K> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

/// Timed events, earliest first, ties in push order.
#[derive(Clone, Debug)]
pub struct EventQueue<K> {
    heap: BinaryHeap<Timed<K>>,
    seq: u64,
}

impl<K> Default for EventQueue<K> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K> EventQueue<K> {
    /// An empty queue.
    pub fn new() -> Self {
        Self {
            heap: BinaryHeap::new(),
            seq: 0,
        }
    }

    /// Schedule `kind` at `time`.
    pub fn push(&mut self, time: u64, kind: K) {
        self.seq += 1;
        self.heap.push(Timed {
            time,
            seq: self.seq,
            kind,
        });
    }

    /// Take the earliest event.
    pub fn pop(&mut self) -> Option<(u64, K)> {
        self.heap.pop().map(|t| (t.time, t.kind))
    }

    /// Time of the earliest event.
    pub fn peek_time(&self) -> Option<u64> {
        self.heap.peek().map(|t| t.time)
    }

    /// Events waiting.
    pub fn len(&self) -> usize {
        self.heap.len()
    }

    /// No event waiting.
    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }
}

/// The event loop: pop events in order and hand each to `handle` with the
/// queue (to schedule follow-ups), until none is left or the next one is
/// later than `time_limit` (it then stays queued). Returns the time of the
/// last event handled (0 if none).
pub fn drive<K>(
    queue: &mut EventQueue<K>,
    time_limit: Option<u64>,
    mut handle: impl FnMut(u64, K, &mut EventQueue<K>),
) -> u64 {
    let mut now = 0;
    while let Some(t) = queue.peek_time() {
        if time_limit.is_some_and(|lim| t > lim) {
            break;
        }
        let Some((t, kind)) = queue.pop() else {
            break;
        };
        now = t;
        handle(t, kind, queue);
    }
    now
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn earliest_first_ties_in_push_order() {
        let mut q = EventQueue::new();
        q.push(5, "b");
        q.push(1, "a");
        q.push(5, "c");
        assert_eq!(q.len(), 3);
        assert_eq!(q.pop(), Some((1, "a")));
        assert_eq!(q.pop(), Some((5, "b")));
        assert_eq!(q.pop(), Some((5, "c")));
        assert!(q.is_empty());
    }

    #[test]
    fn drive_handles_follow_ups_and_stops_at_the_limit() {
        let mut q = EventQueue::new();
        q.push(0, 0u32);
        let mut seen = Vec::new();
        let end = drive(&mut q, Some(30), |now, n, q| {
            seen.push((now, n));
            q.push(now + 10, n + 1);
        });
        assert_eq!(end, 30);
        assert_eq!(seen, vec![(0, 0), (10, 1), (20, 2), (30, 3)]);
        assert_eq!(q.peek_time(), Some(40), "the later event stays queued");
    }
}
