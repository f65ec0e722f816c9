//! Durable state behind one interface: the embedded single-file store by
//! default ([`embedded`]), etcd for several dispatcher replicas with one
//! elected leader ([`etcd`], fenced by the leader's lease).
//!
//! The core commits every batch of state changes before it acknowledges
//! any of them (to a client, an agent, or a watcher), so after a crash the
//! store holds every accepted job in its last acknowledged state. The
//! commit runs on the store's own thread ([`committer`]) while the core
//! applies the next batch.

pub mod committer;
pub mod embedded;
pub mod etcd;

use std::collections::HashMap;
use std::sync::Arc;

use proto::v1::Job;

use crate::record::{JobKey, JobRecord};
use thiserror::Error;

/// An administrative state of a node that must survive restarts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeAdmin {
    /// Schedulable.
    Ready,
    /// No new jobs.
    Cordoned,
    /// No new jobs; running ones finish.
    Draining,
}

impl NodeAdmin {
    fn to_u8(self) -> u8 {
        match self {
            NodeAdmin::Ready => 0,
            NodeAdmin::Cordoned => 1,
            NodeAdmin::Draining => 2,
        }
    }

    fn from_u8(v: u8) -> Self {
        match v {
            1 => NodeAdmin::Cordoned,
            2 => NodeAdmin::Draining,
            _ => NodeAdmin::Ready,
        }
    }
}

/// One change in a commit.
#[derive(Clone, Debug)]
pub enum Write {
    /// Insert or replace a job by id (the job table's record, shared:
    /// its proto is built and encoded at commit, on the store's thread).
    PutJob(Arc<JobRecord>),
    /// Remove a job (garbage collection of old terminal jobs), by its
    /// key: the core names it without formatting its id (a string per
    /// forgotten job), and the embedded store finds its row by number.
    DeleteJob(JobKey),
    /// A node's administrative state.
    PutNodeAdmin(String, NodeAdmin),
    /// The next job number.
    PutNextJob(u64),
}

impl Write {
    /// A write of a job given as its proto (tests, tools).
    pub fn put_job(job: Job) -> Option<Self> {
        JobRecord::from_proto(job).map(|r| Write::PutJob(Arc::new(r)))
    }
}

/// Everything the store holds, read at start-up.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// All jobs.
    pub jobs: Vec<Job>,
    /// Administrative node states.
    pub node_admin: HashMap<String, NodeAdmin>,
    /// The next job number to hand out.
    pub next_job: u64,
}

/// Store failures.
#[derive(Debug, Error)]
pub enum StoreError {
    /// The backend failed.
    #[error("store backend: {0}")]
    Backend(String),
    /// A stored record could not be decoded.
    #[error("corrupt record {key:?}: {reason}")]
    Corrupt {
        /// The record's key.
        key: String,
        /// Why.
        reason: String,
    },
    /// This replica is not the leader any more (its lease expired or
    /// another replica was elected): the write was refused and nothing
    /// of it is visible. The replica must step down.
    #[error("fenced, not the leader any more: {0}")]
    Fenced(String),
}

/// A durable store of the dispatcher's state.
pub trait Store: Send + 'static {
    /// Read everything.
    fn load(&self) -> Result<Snapshot, StoreError>;
    /// Apply `writes` atomically and durably: when this returns `Ok`, all
    /// of them survive a crash; when it fails, none is visible.
    fn commit(&mut self, writes: &[Write]) -> Result<(), StoreError>;
    /// The largest encoded job spec this store can hold in one record, if
    /// it has a limit: the core refuses larger submissions up front
    /// rather than fail a commit.
    fn max_spec_bytes(&self) -> Option<usize> {
        None
    }
}
