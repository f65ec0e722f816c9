//! A bounded message channel with Linux pipe wakeup semantics, shared by
//! the workloads: one reader, any number of writers, a capacity in
//! messages. The pipe only keeps counts and wait queues; the workload
//! performs the wakes it returns (through [`StepCx::wake`]) and blocks its
//! task when told to wait.
//!
//! Semantics, after `fs/pipe.c` (5.x):
//! - A write to a full pipe waits in the writers' queue (exclusive wait,
//!   FIFO); a read from an empty pipe waits, or sees end-of-file when every
//!   writer has closed its end.
//! - A write wakes the waiting reader (it was waiting, so the pipe was
//!   empty: `was_empty`).
//! - A read from a full pipe wakes one waiting writer (`was_full`); a
//!   writer that leaves room after its write wakes the next waiting writer
//!   (`wake_next_writer`), so no writer is left waiting while there is
//!   room.
//! - Closing the last writer end wakes a waiting reader (end-of-file).
//!
//! [`StepCx::wake`]: super::StepCx::wake

use std::collections::VecDeque;

use crate::task::TaskId;

/// Result of [`Pipe::write`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteOutcome {
    /// Written; wake these tasks (reader, next writer).
    Done([Option<TaskId>; 2]),
    /// The pipe is full: the writer is queued and must block.
    Wait,
}

/// Result of [`Pipe::read`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReadOutcome {
    /// A message was read; wake this writer if any. `was_full` tells
    /// whether the read made room in a full pipe.
    Done {
        /// A waiting writer to wake.
        wake: Option<TaskId>,
        /// The pipe was full before the read.
        was_full: bool,
    },
    /// The pipe is empty: the reader is recorded and must block.
    Wait,
    /// Empty and every writer closed.
    Eof,
}

/// One pipe.
#[derive(Clone, Debug)]
pub struct Pipe {
    capacity: u32,
    len: u32,
    reader_waiting: Option<TaskId>,
    writers_waiting: VecDeque<TaskId>,
    writers_open: u32,
    /// Messages written.
    pub written: u64,
    /// Messages read.
    pub read: u64,
}

impl Pipe {
    /// An empty pipe of `capacity` messages (at least 1) with
    /// `writers` open writer ends.
    pub fn new(capacity: u32, writers: u32) -> Self {
        Self {
            capacity: capacity.max(1),
            len: 0,
            reader_waiting: None,
            writers_waiting: VecDeque::new(),
            writers_open: writers,
            written: 0,
            read: 0,
        }
    }

    /// Messages buffered.
    pub fn len(&self) -> u32 {
        self.len
    }

    /// True when nothing is buffered.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// True when the buffer is full.
    pub fn is_full(&self) -> bool {
        self.len >= self.capacity
    }

    /// Writers queued on a full pipe.
    pub fn nr_writers_waiting(&self) -> usize {
        self.writers_waiting.len()
    }

    /// True when the reader is waiting.
    pub fn reader_waiting(&self) -> bool {
        self.reader_waiting.is_some()
    }

    /// `me` writes one message.
    pub fn write(&mut self, me: TaskId) -> WriteOutcome {
        if self.is_full() {
            if !self.writers_waiting.contains(&me) {
                self.writers_waiting.push_back(me);
            }
            return WriteOutcome::Wait;
        }
        self.len += 1;
        self.written += 1;
        let reader = self.reader_waiting.take();
        let next_writer = if self.is_full() {
            None
        } else {
            self.writers_waiting.pop_front()
        };
        WriteOutcome::Done([reader, next_writer])
    }

    /// `me` (the reader) reads one message.
    pub fn read(&mut self, me: TaskId) -> ReadOutcome {
        if self.len == 0 {
            if self.writers_open == 0 {
                return ReadOutcome::Eof;
            }
            self.reader_waiting = Some(me);
            return ReadOutcome::Wait;
        }
        let was_full = self.is_full();
        self.len -= 1;
        self.read += 1;
        let wake = if was_full {
            self.writers_waiting.pop_front()
        } else {
            None
        };
        ReadOutcome::Done { wake, was_full }
    }

    /// A writer closes its end; returns the reader to wake when this was
    /// the last writer and the reader waits (end-of-file).
    pub fn close_writer(&mut self) -> Option<TaskId> {
        self.writers_open = self.writers_open.saturating_sub(1);
        if self.writers_open == 0 && self.len == 0 {
            self.reader_waiting.take()
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_pipe_queues_writers_and_chains_wakes() {
        let (r, a, b) = (TaskId(0), TaskId(1), TaskId(2));
        let mut p = Pipe::new(2, 2);
        assert_eq!(p.read(r), ReadOutcome::Wait);
        assert_eq!(p.write(a), WriteOutcome::Done([Some(r), None]));
        assert_eq!(p.write(a), WriteOutcome::Done([None, None]));
        assert_eq!(p.write(a), WriteOutcome::Wait);
        assert_eq!(p.write(b), WriteOutcome::Wait);
        assert_eq!(
            p.read(r),
            ReadOutcome::Done {
                wake: Some(a),
                was_full: true
            }
        );
        assert_eq!(
            p.read(r),
            ReadOutcome::Done {
                wake: None,
                was_full: false
            }
        );
        // a writes, room is left: the next writer is woken.
        assert_eq!(p.write(a), WriteOutcome::Done([None, Some(b)]));
        assert_eq!(p.written, 3);
        assert_eq!(p.read, 2);
    }

    #[test]
    fn eof_after_last_writer_closes() {
        let r = TaskId(0);
        let mut p = Pipe::new(4, 2);
        assert_eq!(p.read(r), ReadOutcome::Wait);
        assert_eq!(p.close_writer(), None);
        assert_eq!(p.close_writer(), Some(r));
        assert_eq!(p.read(r), ReadOutcome::Eof);
    }
}
