//! What the core reports to besides its callers: the Prometheus metrics
//! ([`crate::metrics`]), the web page's snapshot ([`crate::web`]) and the
//! OTLP traces ([`crate::telemetry`]). Each implements [`Observer`]; the
//! core is built with the [`Observers`] the process wants (none in most
//! tests, fakes in the core's own), never reaching them through globals.
//!
//! Observers never hold up the core: they record into atomics or swap an
//! `Arc` under a short lock, and send the core no command.

use std::collections::HashMap;
use std::sync::Arc;

use proto::v1::JobEvent;

use crate::cluster::{Cluster, JobRecord, Move};

/// One observer of the core. Every method has a default that ignores the
/// report, so each observer implements what it uses.
pub trait Observer: Send + Sync {
    /// This replica started (`true`) or stopped (`false`, its core has
    /// stopped) leading: what was published about the cluster is stale.
    fn leading(&self, leading: bool) {
        let _ = leading;
    }

    /// The core validated and placed `jobs` submitted specs in `seconds`
    /// (whether or not they were accepted).
    fn submitted(&self, jobs: usize, seconds: f64) {
        let _ = (jobs, seconds);
    }

    /// `jobs` were created by a request carrying the W3C trace context
    /// `carrier` (never empty); reported before the batch's events.
    fn submitted_in_trace(&self, jobs: &[Arc<JobRecord>], carrier: &HashMap<String, String>) {
        let _ = (jobs, carrier);
    }

    /// A batch's commit of `writes` writes took `seconds` on the store's
    /// thread (reported when the core waits for it, before its release).
    fn stored(&self, writes: usize, seconds: f64) {
        let _ = (writes, seconds);
    }

    /// The core's tick: sample or publish the cluster's state.
    fn tick(&self, cluster: &Cluster, now_ms: i64) {
        let _ = (cluster, now_ms);
    }

    /// The job events of a committed batch, before its agent messages
    /// leave.
    fn committed(&self, events: &[JobEvent]) {
        let _ = events;
    }

    /// The placements and steals of a committed batch.
    fn moved(&self, moves: &[Move]) {
        let _ = moves;
    }

    /// The W3C trace context to send with job `job_id`'s assignment; empty
    /// when this observer traces nothing.
    fn trace_context(&self, job_id: &str) -> HashMap<String, String> {
        let _ = job_id;
        HashMap::new()
    }
}

/// The observers of one core, called in the order they were added (the
/// metrics before the web page, whose snapshot reads their job counts).
#[derive(Clone, Default)]
pub struct Observers {
    list: Vec<Arc<dyn Observer>>,
}

impl Observers {
    /// No observer.
    pub fn none() -> Self {
        Self::default()
    }

    /// These observers and `o` after them.
    pub fn with(mut self, o: Arc<dyn Observer>) -> Self {
        self.list.push(o);
        self
    }

    /// No observer: nothing reads the batches' job events or moves.
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// See [`Observer::leading`].
    pub fn leading(&self, leading: bool) {
        self.list.iter().for_each(|o| o.leading(leading));
    }

    /// See [`Observer::submitted`] and [`Observer::submitted_in_trace`].
    pub fn submitted(
        &self,
        n: usize,
        seconds: f64,
        jobs: &[Arc<JobRecord>],
        carrier: &HashMap<String, String>,
    ) {
        for o in &self.list {
            o.submitted(n, seconds);
            if !jobs.is_empty() && !carrier.is_empty() {
                o.submitted_in_trace(jobs, carrier);
            }
        }
    }

    /// See [`Observer::tick`].
    pub fn tick(&self, cluster: &Cluster, now_ms: i64) {
        self.list.iter().for_each(|o| o.tick(cluster, now_ms));
    }

    /// See [`Observer::committed`].
    pub fn committed(&self, events: &[JobEvent]) {
        self.list.iter().for_each(|o| o.committed(events));
    }

    /// See [`Observer::stored`].
    pub fn stored(&self, writes: usize, seconds: f64) {
        self.list.iter().for_each(|o| o.stored(writes, seconds));
    }

    /// See [`Observer::moved`].
    pub fn moved(&self, moves: &[Move]) {
        self.list.iter().for_each(|o| o.moved(moves));
    }

    /// The first non-empty [`Observer::trace_context`]; `None` when no
    /// observer traces the job.
    pub fn trace_context(&self, job_id: &str) -> Option<HashMap<String, String>> {
        self.list
            .iter()
            .map(|o| o.trace_context(job_id))
            .find(|c| !c.is_empty())
    }
}
