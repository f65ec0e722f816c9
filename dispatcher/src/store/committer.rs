//! The store on a thread of its own (`dispatch-store`), so that a batch's
//! commit (encoding its records, the store's B-tree or etcd's round trip,
//! the fsync) runs while the core applies the next batch.
//!
//! The core hands over a batch's writes ([`Committer::start`]) and, before
//! it releases anything of that batch (replies, agent messages, events),
//! waits for the result ([`Committer::wait`]). At most one commit is in
//! flight and commits happen in the order they were started, so a batch is
//! durable before any later one, and nothing is acknowledged before it is
//! stored. Every batch is committed, an empty one too: a store may refuse
//! it (etcd's lease clock), which stops its agent messages.

use std::sync::mpsc;
use std::thread::JoinHandle;

use super::{Store, StoreError, Write};

/// The store's thread and the one commit it may have in flight.
pub struct Committer {
    writes: Option<mpsc::Sender<Vec<Write>>>,
    done: mpsc::Receiver<(Result<(), StoreError>, Stored)>,
    thread: Option<JoinHandle<()>>,
    in_flight: bool,
    /// The commits waited for since [`Committer::take_stored`] last took
    /// them.
    stored: Vec<Stored>,
}

/// One commit as the store's thread timed it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Stored {
    /// Writes handed over (before only the last of each record is kept).
    pub writes: usize,
    /// Seconds `Store::commit` took (encoding, the B-tree or etcd's round
    /// trip, the fsync).
    pub seconds: f64,
}

fn gone() -> StoreError {
    StoreError::Backend("the store's thread has stopped".into())
}

impl Committer {
    /// Start the thread owning `store`.
    pub fn spawn(mut store: Box<dyn Store>) -> Result<Self, StoreError> {
        let (writes, batches) = mpsc::channel::<Vec<Write>>();
        let (results, done) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("dispatch-store".into())
            .spawn(move || {
                for batch in batches {
                    let started = std::time::Instant::now();
                    let r = store.commit(&batch);
                    let took = started.elapsed();
                    tracing::debug!(
                        target: "lat",
                        writes = batch.len(),
                        us = took.as_micros() as u64,
                        "committed"
                    );
                    let stored = Stored {
                        writes: batch.len(),
                        seconds: took.as_secs_f64(),
                    };
                    // The records go back to the job table's sole ownership
                    // before the core hears of the result.
                    drop(batch);
                    if results.send((r, stored)).is_err() {
                        return;
                    }
                    crate::idle::idle();
                }
            })
            .map_err(|e| StoreError::Backend(format!("cannot start the store's thread: {e}")))?;
        Ok(Self {
            writes: Some(writes),
            done,
            thread: Some(thread),
            in_flight: false,
            stored: Vec::new(),
        })
    }

    /// Whether a commit was started and not waited for.
    pub fn in_flight(&self) -> bool {
        self.in_flight
    }

    /// Commit `writes` on the store's thread. The commit in flight, if any,
    /// is waited for first (its error, if it failed, is returned and
    /// `writes` are not committed).
    pub fn start(&mut self, writes: Vec<Write>) -> Result<(), StoreError> {
        self.wait()?;
        self.writes
            .as_ref()
            .ok_or_else(gone)?
            .send(writes)
            .map_err(|_| gone())?;
        self.in_flight = true;
        Ok(())
    }

    /// The result of the commit in flight, once it is done (`Ok` when none
    /// is in flight).
    pub fn wait(&mut self) -> Result<(), StoreError> {
        if !std::mem::take(&mut self.in_flight) {
            return Ok(());
        }
        let (r, stored) = self.done.recv().map_err(|_| gone())?;
        self.stored.push(stored);
        r
    }

    /// The commits waited for since the last call, oldest first (failed
    /// ones too: their time was spent). Drained in place: no allocation
    /// per commit.
    pub fn take_stored(&mut self) -> std::vec::Drain<'_, Stored> {
        self.stored.drain(..)
    }

    /// Commit `writes` and wait for it.
    pub fn commit(&mut self, writes: Vec<Write>) -> Result<(), StoreError> {
        self.start(writes)?;
        self.wait()
    }
}

impl Drop for Committer {
    /// Ends the thread once its last commit is done, and drops the store
    /// (a reopened embedded store finds its file closed).
    fn drop(&mut self) {
        self.writes = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use proto::v1::Job;

    use super::*;
    use crate::record::{JobKey, JobRecord};
    use crate::store::Snapshot;

    /// Records each commit's job ids; fails the commit of a write naming j-0.
    struct Log(Arc<Mutex<Vec<Vec<String>>>>);

    impl Store for Log {
        fn load(&self) -> Result<Snapshot, StoreError> {
            Ok(Snapshot::default())
        }

        fn commit(&mut self, writes: &[Write]) -> Result<(), StoreError> {
            let ids: Vec<String> = writes
                .iter()
                .filter_map(|w| match w {
                    Write::PutJob(j) => Some(j.id()),
                    Write::DeleteJob(key) => Some(key.to_string()),
                    _ => None,
                })
                .collect();
            if ids.iter().any(|i| i == "j-0") {
                return Err(StoreError::Backend("bad".into()));
            }
            self.0.lock().unwrap().push(ids);
            Ok(())
        }
    }

    /// A write naming job `n` (a delete: no record to build).
    fn write(n: u64) -> Write {
        Write::DeleteJob(JobKey::single(n))
    }

    #[test]
    fn commits_run_in_order_one_at_a_time_and_errors_come_back() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let mut c = Committer::spawn(Box::new(Log(log.clone()))).unwrap();
        assert!(c.wait().is_ok(), "nothing in flight");
        c.start(vec![write(1)]).unwrap();
        assert!(c.in_flight());
        // The next start waits for the first.
        c.start(vec![write(2), write(3)]).unwrap();
        c.commit(Vec::new()).unwrap();
        assert!(!c.in_flight());
        assert_eq!(
            *log.lock().unwrap(),
            vec![
                vec!["j-1".to_string()],
                vec!["j-2".into(), "j-3".into()],
                vec![]
            ]
        );
        // Each commit waited for is reported once, in order, with its writes.
        let writes: Vec<usize> = c.take_stored().map(|s| s.writes).collect();
        assert_eq!(writes, [1, 2, 0]);
        assert_eq!(c.take_stored().len(), 0);
        c.start(vec![write(0)]).unwrap();
        assert!(matches!(c.wait(), Err(StoreError::Backend(_))));
        assert_eq!(
            c.take_stored().len(),
            1,
            "a failed commit's time counts too"
        );
        // The records were let go of before the result came back.
        let job = Arc::new(
            JobRecord::from_proto(Job {
                id: "j-1".into(),
                ..Default::default()
            })
            .unwrap(),
        );
        c.commit(vec![Write::PutJob(job.clone())]).unwrap();
        assert_eq!(Arc::strong_count(&job), 1);
    }
}
