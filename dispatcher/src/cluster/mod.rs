//! The cluster state and the job lifecycle, synchronous and without I/O:
//! each operation mutates the state and appends what must happen outside
//! to an [`Effects`] — store writes, messages to agents, events for
//! watchers, moves for observers — which the core (`core.rs`) commits to
//! the store *before* it acknowledges or sends anything.
//!
//! The parts, each owning one thing:
//! - [`jobs`]: the job table; each job's [`Phase`] says where it is and
//!   why (user states, node and reason are derived from it), with indexes
//!   by node and by phase;
//! - [`nodes`]: the node registry (labels, topology, CPU model, heartbeats,
//!   administrative state);
//! - [`engine`]: the node-level `sched` engine, its leaf order and rebuild;
//! - `lifecycle`: submit, place, start, status, finish, loss, cancel;
//! - `reconcile`: agent registration and reconciliation;
//! - [`steal`]: agent-level steals and the recent moves;
//! - [`pending`]: why a waiting job waits (the API's `PendingReason`),
//!   computed when a job is read, never stored.
//! - [`gang`]: multi-node gangs: all members start together or none does,
//!   the waiting gang's reservation, member loss and the retry policy;
//! - [`wakers`]: waker identities and their wake_wide flip records, kept
//!   outside the engine so that rebuilds and re-placements keep them.
//! - [`runtimes`]: each user's last run times, the run-time predictions
//!   EASY backfill may count on ([`ClusterConfig::predict`]).
//!
//! Job states for users: PENDING (phases `Unplaced`, `Queued`), ASSIGNED
//! (`Assigned`), RUNNING (`Running`), both also `AwaitingNode` after a
//! restart, then SUCCEEDED / FAILED / CANCELLED / LOST (`Done`). In the
//! engine a `Queued` job is a task (waiting ones are stealable by idle
//! nodes of the rack), an `Assigned` or `Running` job a running task;
//! `Unplaced` and `AwaitingNode` jobs are not in the engine.

pub mod engine;
pub mod gang;
mod gpus;
pub mod jobs;
mod lifecycle;
pub mod listing;
pub mod load;
pub mod nodes;
pub mod pending;
mod reconcile;
pub mod runtimes;
pub mod shapes;
mod slab;
pub mod steal;
pub mod wakers;

use std::collections::hash_map::Entry;
use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use proto::v1::{
    Cancel, DispatcherMessage, Job, JobEvent, JobSpec, JobState, ListJobsRequest,
    dispatcher_message,
};
use sched::{LeafId, Sched, SchedConfig};
use tonic::Status;

pub use crate::record::{JobRecord, NodeName};
pub use engine::NodeEngine;
pub use jobs::{End, JobKey, Phase, Requeue, StealLevel, Unplaced, Via};
pub use nodes::{NodeInfo, Place};
pub use steal::{Move, MoveKind, RECENT_MOVES};

use crate::spec::SpecLimits;
use crate::store::{Snapshot, Write};
use jobs::Jobs;
use nodes::{NodeSlot, Nodes};
use steal::RecentMoves;

/// Labels and timings of the cluster.
#[derive(Clone, Debug)]
pub struct ClusterConfig {
    /// Label naming a node's zone (the NUMA level of the cluster).
    pub zone_label: String,
    /// Label naming a node's rack (the LLC level).
    pub rack_label: String,
    /// Label naming a node's host group (the SMT level).
    pub hostgroup_label: String,
    /// Label naming a node's region (the package level).
    pub region_label: String,
    /// Agents report at least this often.
    pub heartbeat_interval_ms: u64,
    /// Reports missed before a node is DOWN.
    pub missed_heartbeats: u64,
    /// The node-level engine's configuration.
    pub engine: SchedConfig,
    /// Spec limits.
    pub limits: SpecLimits,
    /// How long terminal jobs are kept (Slurm's MinJobAge and a cap).
    pub retention: Retention,
    /// Wipe period of the wakers' flip records (seed 001's one second at
    /// CPU level; jobs wake jobs on a scale of seconds to minutes).
    pub wake_flip_decay_ms: u64,
    /// Which jobs get a run-time prediction from their user's history
    /// ([`runtimes`], EASY++), which EASY backfill counts on.
    pub predict: runtimes::Predict,
    /// How a job whose waker is only its owner is placed
    /// ([`wakers::OwnerWake`]).
    pub owner_wake: wakers::OwnerWake,
}

/// Default of [`ClusterConfig::wake_flip_decay_ms`]: one minute.
pub const WAKE_FLIP_DECAY_MS: u64 = 60_000;

/// The most runnable jobs per CPU an agent may announce (`Register`).
pub const MAX_OVERSUBSCRIBE: u32 = 64;

impl ClusterConfig {
    /// The lease agents get (`Registered.lease_ms`): one heartbeat
    /// interval shorter than the deadline after which `tick` declares a
    /// node lost and retries its jobs (half the deadline when that is a
    /// single interval). The agent counts it from a report's send time,
    /// before this dispatcher received it, so when a node is declared
    /// lost its agent has fenced its jobs for at least that margin.
    pub fn agent_lease_ms(&self) -> u64 {
        let deadline = self.heartbeat_interval_ms * self.missed_heartbeats;
        (deadline - deadline.min(self.heartbeat_interval_ms)).max(deadline / 2)
    }
}

impl Default for ClusterConfig {
    fn default() -> Self {
        let mut engine = SchedConfig::cluster();
        engine.steal_cross_llc = true;
        engine.steal_cost = 0;
        // Chosen by measurement (docs/BENCHMARKS.md, "Choosing the
        // defaults"): EASY backfill within a node wins on every workload;
        // the idle-balance pass and longest-wait pulls add little for
        // their cost and stay off.
        engine.backfill = true;
        // Also by measurement ("Choosing the defaults", latency classes):
        // latency-class jobs waiting in a node's steal domain start first
        // where room opens; p99 wait of the latency class 4-250x better
        // than batch on every queueing workload, batch makespan unchanged.
        engine.latency_pull = true;
        // Also by measurement ("Placement quality (issue 13, third
        // pass)"): one reservation and one queue per steal domain, as
        // EASY keeps one queue and protects its oldest job; per-node
        // reservations and queues lost to a central queue on KTH-SP2.
        engine.domain_reservation = true;
        engine.domain_fifo = true;
        // Also by measurement ("Placement quality (issue 13, fourth
        // pass)"): the domain's queue shortest time limit first (EASY's
        // SJBF), the oldest head keeping the reservation; better in
        // bounded slowdown and mean response on every workload with limits.
        engine.shortest_limit_first = true;
        // Also by measurement (quality3's notes and "The limit_aging
        // default" in docs/BENCHMARKS.md): a job that has waited as long as
        // its own limit goes ahead of the shorter ones. Meets the
        // utilization target on 8-CPU nodes, where shortest first alone
        // strands whole-node jobs; mean and bsld stay better than
        // least-loaded on every workload.
        engine.limit_aging = true;
        // Also by measurement (docs/BENCHMARKS.md, "Session 37 (lead)"):
        // the widest job that fits first, in both tiers. Over 51 runs of
        // shapes no generated table uses, against shortest first alone:
        // mean response 5-6% lower, p99 wait 22% lower, the widest jobs'
        // longest wait 18-37% shorter, bounded slowdown within 2%, more
        // CPUs busy while work waits in every run. KTH-SP2 split in parts
        // is the one loss (mean response +1.6%, bsld 44 -> 49).
        engine.widest_first = sched::WidestFirst::Always;
        Self {
            zone_label: "topology.kubernetes.io/zone".into(),
            rack_label: "dispatch.io/rack".into(),
            hostgroup_label: "dispatch.io/hostgroup".into(),
            region_label: "topology.kubernetes.io/region".into(),
            heartbeat_interval_ms: 1000,
            missed_heartbeats: 3,
            engine,
            limits: SpecLimits::default(),
            wake_flip_decay_ms: WAKE_FLIP_DECAY_MS,
            retention: Retention::default(),
            predict: runtimes::Predict::Off,
            owner_wake: wakers::OwnerWake::default(),
        }
    }
}

/// How long a terminal job (SUCCEEDED, FAILED, CANCELLED, LOST) stays
/// readable: in memory and in the store, then both forget it (the tick
/// deletes it in the store with the tick's commit).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Retention {
    /// A terminal job is kept at least this long after it ended (ms;
    /// Slurm's MinJobAge, 300 s by default)...
    pub min_age_ms: i64,
    /// ... unless more terminal jobs than this are kept: then the ones
    /// that ended first go first, younger or not (Slurm's MaxJobCount
    /// bound, here on terminal jobs only).
    pub max_done_jobs: usize,
}

impl Retention {
    /// Keep every job (the simulator: a waker job's node is looked up
    /// however long ago it ended); nothing is tracked for the retention.
    pub const KEEP_ALL: Self = Self {
        min_age_ms: i64::MAX,
        max_done_jobs: usize::MAX,
    };
}

impl Default for Retention {
    fn default() -> Self {
        Self {
            min_age_ms: 300_000,
            max_done_jobs: 100_000,
        }
    }
}

/// What an operation requires of the outside world. Job records are
/// carried shared (`Arc<JobRecord>`, the job table's own record), never
/// copied here: the proto is built only where it is read (the store
/// encodes the shared record; [`JobChange::to_event`] builds the
/// watchers' event).
#[derive(Debug, Default)]
pub struct Effects {
    /// Store writes, committed before anything else is released. The
    /// jobs' records join them at the batch's end
    /// ([`Cluster::write_back`] of [`Effects::dirty`]).
    pub writes: Vec<Write>,
    /// The jobs whose records changed, to be stored: one `PutJob` each,
    /// the record as the batch left it ([`Cluster::write_back`]). A
    /// write that held the record from each change made the job's next
    /// change in the batch copy it (`Arc::make_mut`): about three copies
    /// per job, each an allocation on the core and a free on the store's
    /// thread, of records the commit then skipped (it stores the last
    /// write of each).
    pub dirty: Vec<JobKey>,
    /// Nobody reads this batch's events (no watcher, no observer): none
    /// is recorded. An event holds its job's record as the change left
    /// it, so the job's next change in the batch copies the record.
    pub drop_events: bool,
    /// Messages to agents, by node name.
    pub to_agents: Vec<(NodeName, ToAgent)>,
    /// Job state changes for watchers and observers.
    pub events: Vec<JobChange>,
    /// Placements and steals, in the order they happened.
    pub moves: Vec<Move>,
}

impl Effects {
    /// Empty effects with room for `sizes` of each (see
    /// [`Effects::sizes`]): the core sizes a batch's effects by the last
    /// batch's, since grown from empty one push at a time a batch of 500
    /// jobs reallocated and copied each vector nine times.
    pub fn with_room(sizes: [usize; 4]) -> Self {
        // A rare huge batch (a large array) does not size every later one.
        const MAX_ROOM: usize = 8192;
        let [writes, to_agents, events, moves] = sizes.map(|n| n.min(MAX_ROOM));
        Self {
            writes: Vec::with_capacity(writes),
            // About one changed job per write.
            dirty: Vec::with_capacity(writes),
            to_agents: Vec::with_capacity(to_agents),
            events: Vec::with_capacity(events),
            moves: Vec::with_capacity(moves),
            drop_events: false,
        }
    }

    /// Name `key` among the jobs to write at the batch's end (once for
    /// its changes in a row: a job's way through an operation changes it
    /// several times).
    pub fn mark_dirty(&mut self, key: JobKey) {
        if self.dirty.last() != Some(&key) {
            self.dirty.push(key);
        }
    }

    /// How many writes, agent messages, events and moves it holds.
    pub fn sizes(&self) -> [usize; 4] {
        [
            self.writes.len(),
            self.to_agents.len(),
            self.events.len(),
            self.moves.len(),
        ]
    }
}

/// A message to an agent as an operation leaves it. A plain job's
/// `Assign` is its shared record (the table's, as the start left it),
/// built into the proto only when it is sent ([`ToAgent::into_message`],
/// which the agent stream's queue calls where the stream reads it, off
/// the core thread): building it on the core copied the spec, the id and
/// the owner at every start.
// Not boxed: most messages are built ones (a lease per heartbeat), and
// a box would add an allocation to each; the effects are short-lived.
#[allow(clippy::large_enum_variant)]
#[derive(Clone, Debug)]
pub enum ToAgent {
    /// A message as it goes on the wire (a gang member's `Assign`, whose
    /// spec carries its gang, is built at once).
    Msg(DispatcherMessage),
    /// The `Assign` of the record's current attempt
    /// ([`JobRecord::assign`]).
    Assign(Arc<JobRecord>),
}

impl ToAgent {
    /// The message as it goes on the wire.
    pub fn into_message(self) -> DispatcherMessage {
        match self {
            ToAgent::Msg(m) => m,
            ToAgent::Assign(job) => job.assign(),
        }
    }

    /// [`ToAgent::into_message`] of a copy (tests and readers that keep
    /// the effects).
    pub fn message(&self) -> DispatcherMessage {
        self.clone().into_message()
    }

    /// The job an `Assign` (either form) sends, by id.
    pub fn assigned_id(&self) -> Option<std::borrow::Cow<'_, str>> {
        match self {
            ToAgent::Assign(job) => Some(job.id().into()),
            ToAgent::Msg(DispatcherMessage {
                msg: Some(dispatcher_message::Msg::Assign(a)),
            }) => Some(a.job_id.as_str().into()),
            ToAgent::Msg(_) => None,
        }
    }

    /// The job and attempt an `Assign` (either form) sends.
    fn assigned(&self) -> Option<(JobKey, u32)> {
        match self {
            ToAgent::Assign(job) => Some((job.key(), job.attempt)),
            ToAgent::Msg(DispatcherMessage {
                msg: Some(dispatcher_message::Msg::Assign(a)),
            }) => Some((JobKey::parse(&a.job_id)?, a.attempt)),
            ToAgent::Msg(_) => None,
        }
    }
}

impl From<DispatcherMessage> for ToAgent {
    fn from(m: DispatcherMessage) -> Self {
        ToAgent::Msg(m)
    }
}

/// A job's state change: the record after it (shared with the job
/// table until the job changes again), the state before, and when.
#[derive(Clone, Debug)]
pub struct JobChange {
    /// The job as the change left it.
    pub job: Arc<JobRecord>,
    /// Its state before (`JobState` as i32).
    pub previous_state: i32,
    /// When (Unix ms).
    pub time_ms: i64,
}

impl JobChange {
    /// The watchers' event (the record's proto).
    pub fn to_event(&self) -> JobEvent {
        JobEvent {
            job: Some(self.job.to_proto()),
            previous_state: self.previous_state,
            time_ms: self.time_ms,
        }
    }
}

/// The cluster.
pub struct Cluster {
    cfg: ClusterConfig,
    nodes: Nodes,
    jobs: Jobs,
    engine: NodeEngine,
    moves: RecentMoves,
    wakers: wakers::Wakers,
    gangs: gang::Gangs,
    runtimes: runtimes::Runtimes,
    /// The keys a submission created (`submit_as`'s and `submit_each`'s
    /// buffer, kept).
    created: Vec<JobKey>,
    /// The owner of the last submission, shared with the next one's
    /// jobs when it is the same.
    last_owner: Arc<str>,
}

impl Cluster {
    /// An empty cluster.
    pub fn new(cfg: ClusterConfig) -> Self {
        let retained = cfg.retention != Retention::KEEP_ALL;
        Self {
            engine: NodeEngine::new(cfg.engine.clone()),
            wakers: wakers::Wakers::new(cfg.wake_flip_decay_ms, wakers::MAX_WAKERS),
            cfg,
            nodes: Nodes::default(),
            jobs: Jobs::new(retained),
            moves: RecentMoves::default(),
            gangs: gang::Gangs::default(),
            runtimes: runtimes::Runtimes::default(),
            created: Vec::new(),
            last_owner: Arc::from(""),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &ClusterConfig {
        &self.cfg
    }

    /// The largest encoded spec the store holds in one record (None: no
    /// limit); submissions of larger specs are refused.
    pub fn limit_stored_spec_bytes(&mut self, max: Option<usize>) {
        self.cfg.limits.max_stored_spec_bytes = max;
    }

    /// Steals the node-level engine has made so far.
    pub fn steals(&self) -> u64 {
        self.engine.steals()
    }

    /// Set the cost of a steal, measured by the caller (nanoseconds): a
    /// node steals only if its average idle period exceeds it (seed 000's
    /// SCHED_STEAL_COST, which the dispatcher measures instead of assuming).
    pub fn set_steal_cost(&mut self, ns: u64) {
        self.cfg.engine.steal_cost = ns;
        self.engine.set_steal_cost(ns);
    }

    /// The node-level engine (None until a node registers).
    pub fn engine(&self) -> Option<&Sched> {
        self.engine.sched()
    }

    /// The node-level engine with its leaf order.
    pub fn node_engine(&self) -> &NodeEngine {
        &self.engine
    }

    /// The node's leaf in the node-level engine (None before the engine
    /// includes it).
    pub fn engine_leaf(&self, node: &str) -> Option<LeafId> {
        self.engine.leaf(node)
    }

    /// The last placements (jobs sent to a node), oldest first.
    pub fn recent_placements(&self) -> impl DoubleEndedIterator<Item = &Move> {
        self.moves.placements()
    }

    /// The last steals (queued jobs taken by idle nodes, and jobs agents
    /// gave back unstarted), oldest first.
    pub fn recent_steals(&self) -> impl DoubleEndedIterator<Item = &Move> {
        self.moves.steals()
    }

    /// Number of jobs known (all states).
    pub fn nr_jobs(&self) -> usize {
        self.jobs.len()
    }

    /// Where a job is and why.
    pub fn phase(&self, id: &str) -> Option<&Phase> {
        JobKey::parse(id)
            .and_then(|k| self.jobs.get(k))
            .map(|e| e.phase())
    }

    /// Check the state's invariants against brute-force recomputations:
    /// the job indexes and records (see [`jobs`]), and the engine's tasks
    /// against the phases (Queued on its node's leaf, Assigned and Running
    /// running there, Unplaced, AwaitingNode and Done not runnable). For
    /// tests; costs O(jobs).
    pub fn check(&self) -> Result<(), String> {
        self.jobs.check()?;
        self.check_gangs()?;
        // The slots that stand for node names: a job's modelled CPUs are
        // on its node's slot, and the engine's leaves map to their nodes'
        // slots and back.
        for (key, e) in self.jobs.iter() {
            // A name's slot is its node's (the job table lists the job's
            // node by it).
            for name in [Some(&e.job().node), e.phase().node_name()]
                .into_iter()
                .flatten()
            {
                if let Some(s) = NodeSlot::of(name)
                    && self.nodes.at(s).is_none_or(|n| n.name != *name)
                {
                    return Err(format!(
                        "{key}: node {name:?} carries slot {s:?}, which holds {:?}",
                        self.nodes.at(s).map(|n| &n.name)
                    ));
                }
            }
            if !e.model_cpus.is_empty() && e.model_node != self.nodes.slot(&e.job().node) {
                return Err(format!(
                    "{key}: CPUs modelled in slot {:?}, its node {:?} is in {:?}",
                    e.model_node,
                    e.job().node,
                    self.nodes.slot(&e.job().node)
                ));
            }
        }
        for (leaf, name) in self.engine.built_order().iter().enumerate() {
            let slot = self.engine.slot_at(leaf);
            if slot != self.nodes.slot(name)
                || slot.and_then(|s| self.engine.built_leaf_at(s)) != Some(leaf)
            {
                return Err(format!("leaf {leaf} ({name}): slot {slot:?}"));
            }
        }
        let Some(engine) = self.engine.sched() else {
            return Ok(());
        };
        if self.engine.is_dirty() {
            return Ok(());
        }
        for (key, e) in self.jobs.iter() {
            let task = engine.task_state(e.task);
            let leaf = |n: &str| self.engine.leaf(n);
            let ok = match (e.phase(), task) {
                (Phase::Queued { node, .. }, Some(sched::TaskState::Queued(l)))
                | (Phase::Queued { node, .. }, Some(sched::TaskState::Running(l))) => {
                    leaf(node) == Some(l)
                }
                (Phase::Assigned { node, .. } | Phase::Running { node, .. }, Some(t)) => {
                    leaf(node).is_none_or(|l| t == sched::TaskState::Running(l))
                }
                (Phase::Assigned { node, .. } | Phase::Running { node, .. }, None) => {
                    leaf(node).is_none()
                }
                (Phase::Queued { .. }, _) => false,
                (_, t) => !matches!(
                    t,
                    Some(sched::TaskState::Running(_) | sched::TaskState::Queued(_))
                ),
            };
            if !ok {
                return Err(format!(
                    "{key}: phase {:?} but engine task {task:?}",
                    e.phase()
                ));
            }
        }
        // Each node that takes new jobs has its modelled room in the
        // engine: every start, finish and move pushes it
        // (`sync_summary`, `report_summary`, `retire_freeing`).
        for n in self.nodes.iter() {
            let Some(leaf) = self.engine.leaf(&n.name) else {
                continue;
            };
            if !n.schedulable() {
                continue;
            }
            let want = n.engine_room().map(sched::alloc::FreeSummary::normalized);
            let have = engine.rq(leaf).align_free();
            if have != want {
                return Err(format!(
                    "node {}: the engine's room {have:?}, the model's {want:?}",
                    n.name
                ));
            }
        }
        Ok(())
    }

    /// Restore from a store snapshot (after a restart). PENDING jobs wait
    /// for nodes; ASSIGNED/RUNNING ones wait for their node to re-register
    /// and report them, until `now + grace_ms`.
    pub fn restore(&mut self, snap: Snapshot, now: i64, grace_ms: i64) {
        self.jobs.set_next_number(snap.next_job);
        self.nodes.restore_admin(snap.node_admin);
        // An array's (or gang's) elements share its spec again, as they
        // did when submitted: the store gives each its own copy.
        let mut specs: HashMap<u64, Arc<JobSpec>> = HashMap::new();
        for job in snap.jobs {
            let Some(mut job) = JobRecord::from_proto(job) else {
                continue;
            };
            let key = job.key();
            if job.is_element()
                && let Some(spec) = &mut job.spec
            {
                match specs.entry(key.number()) {
                    Entry::Occupied(e) if **e.get() == **spec => *spec = e.get().clone(),
                    Entry::Occupied(_) => {}
                    Entry::Vacant(e) => {
                        e.insert(spec.clone());
                    }
                }
            }
            let state = JobState::try_from(job.state).unwrap_or(JobState::Unspecified);
            let phase = match state {
                JobState::Pending | JobState::Unspecified => Phase::Unplaced {
                    why: Unplaced::Restored,
                },
                JobState::Assigned | JobState::Running => Phase::AwaitingNode {
                    node: job.node.clone(),
                    deadline: now + grace_ms,
                    running: state == JobState::Running,
                },
                done => Phase::Done {
                    state: done,
                    end: End::Reported(String::new()),
                },
            };
            self.jobs.insert(key, job, phase);
        }
        self.gangs
            .restore(self.jobs.iter().map(|(k, e)| (k, e.job())));
        // The run-time history is soft state: rebuilt from the finished
        // jobs the store kept, in the order they ended.
        let mut ended: Vec<&JobRecord> = self
            .jobs
            .iter()
            .map(|(_, e)| e.job())
            .filter(|j| runtimes_count(j))
            .collect();
        ended.sort_by_key(|j| (j.end_time_ms, j.key()));
        for j in ended {
            let group = j.spec().map_or("", |s| s.group.as_str());
            let run = (j.end_time_ms - j.start_time_ms) as u64;
            self.runtimes.record(&j.owner, group, run);
        }
    }

    /// The run-time history ([`runtimes`]).
    pub fn runtimes(&self) -> &runtimes::Runtimes {
        &self.runtimes
    }

    // ------------------------------------------------------------------
    // Queries

    /// Drops from `fx` every `Assign` whose attempt the same batch took
    /// back: the job has ended, moved to a later attempt or to another
    /// node since it was assigned. Say a load report placed a job on a
    /// node that the same batch's tick then found overdue: its retry, or
    /// its loss, and a `Cancel` of the attempt are in the batch too.
    /// Nothing has been sent yet, so the agent is not made to start a
    /// process only to kill it, and no message contradicts the state the
    /// batch commits. The core calls it once per batch, before the
    /// messages are released (one table lookup per `Assign`).
    pub fn drop_taken_back_assigns(&self, fx: &mut Effects) {
        fx.to_agents.retain(|(node, msg)| {
            let Some((key, attempt)) = msg.assigned() else {
                return true;
            };
            self.jobs.get(key).is_some_and(|e| {
                let job = e.job();
                job.attempt == attempt
                    && job.node == *node
                    && !matches!(e.phase(), Phase::Done { .. })
            })
        });
    }

    /// One job by id.
    pub fn get_job(&self, id: &str) -> Result<Job, Status> {
        let key =
            JobKey::parse(id).ok_or_else(|| Status::not_found(format!("id: no job {id:?}")))?;
        match self.jobs.get(key) {
            Some(e) => Ok(e.job().to_proto()),
            None if self.gangs.get(key.number()).is_some() && key.is_single() => {
                let size = self.gangs.get(key.number()).map_or(0, |g| g.size);
                Err(Status::not_found(format!(
                    "id: {id} is a gang of {size}; its members are {id}.0 .. {id}.{} \
                     (dispatchctl ls --gang {id})",
                    size.saturating_sub(1)
                )))
            }
            None if self.jobs.elements(key).next().is_some() => Err(Status::not_found(format!(
                "id: {id} is an array; its elements are {id}.0, {id}.1, ... (dispatchctl ls --array {id})"
            ))),
            None => Err(Status::not_found(format!("id: no job {id:?}"))),
        }
    }

    /// Jobs matching a request, newest first, one page.
    pub fn list_jobs(&self, req: &ListJobsRequest) -> Result<(Vec<Job>, String), Status> {
        let page = match req.page_size {
            0 => 100,
            n if n > 10_000 => return Err(Status::invalid_argument("page_size: at most 10000")),
            n => n as usize,
        };
        let upper =
            if req.page_token.is_empty() {
                None
            } else {
                Some(JobKey::parse(&req.page_token).ok_or_else(|| {
                    Status::invalid_argument("page_token: not a token from ListJobs")
                })?)
            };
        let states: HashSet<i32> = req.states.iter().copied().collect();
        let iter: Box<dyn Iterator<Item = (JobKey, &jobs::JobEntry)>> = match upper {
            Some(u) => Box::new(self.jobs.below(u)),
            None => Box::new(self.jobs.iter().rev()),
        };
        let mut out = Vec::new();
        let mut next = String::new();
        for (_, e) in iter {
            let j = e.job();
            if (!states.is_empty() && !states.contains(&j.state))
                || (!req.node.is_empty() && j.node != req.node)
                || (!req.group.is_empty() && j.spec().is_none_or(|s| s.group != req.group))
                || (!req.array_id.is_empty() && j.array_id() != req.array_id)
                || (!req.gang_id.is_empty() && j.gang_id() != req.gang_id)
                || (!req.owner.is_empty() && *j.owner != req.owner)
            {
                continue;
            }
            if out.len() == page {
                next = out.last().map(|j: &Job| j.id.clone()).unwrap_or_default();
                break;
            }
            out.push(j.to_proto());
        }
        Ok((out, next))
    }

    /// All jobs whose id is in `ids` (all jobs when empty), for watchers
    /// that want the current state first. An array's id matches its
    /// elements, as it does for the watch's later events; each job is sent
    /// once, in id order.
    pub fn jobs_matching(&self, ids: &[String]) -> Vec<Job> {
        if ids.is_empty() {
            return self.jobs.iter().map(|(_, e)| e.job().to_proto()).collect();
        }
        let mut keys = BTreeSet::new();
        for key in ids.iter().filter_map(|id| JobKey::parse(id)) {
            if self.jobs.contains(key) {
                keys.insert(key);
            } else if key.is_single() {
                keys.extend(self.jobs.elements(key));
            }
        }
        keys.iter()
            .filter_map(|k| self.jobs.get(*k).map(|e| e.job().to_proto()))
            .collect()
    }

    /// All nodes, by name.
    pub fn nodes(&self) -> impl Iterator<Item = &NodeInfo> {
        self.nodes.iter()
    }

    /// One node.
    pub fn node(&self, name: &str) -> Result<&NodeInfo, Status> {
        self.nodes.find(name)
    }

    /// Connected node names.
    pub fn connected_nodes(&self) -> Vec<String> {
        self.nodes
            .iter()
            .filter(|n| n.connected)
            .map(|n| n.name.to_string())
            .collect()
    }

    // ------------------------------------------------------------------
    // Effects

    fn persist(&self, key: JobKey, fx: &mut Effects) {
        fx.mark_dirty(key);
    }

    /// [`Self::persist`] a job, and announce its change from `previous`
    /// (a [`JobChange`], unless [`Effects::drop_events`]).
    fn persist_emit(&self, key: JobKey, previous: JobState, now: i64, fx: &mut Effects) {
        fx.mark_dirty(key);
        if !fx.drop_events
            && let Some(job) = self.jobs.record(key)
        {
            fx.events.push(JobChange {
                job,
                previous_state: previous as i32,
                time_ms: now,
            });
        }
    }

    /// The store writes of the jobs `fx` changed ([`Effects::dirty`]):
    /// a `PutJob` of each, its record as it is now. A job forgotten since
    /// has its delete in the writes instead. A commit applies only the
    /// last write of a record, so writing each job's last state is what
    /// writing each of its changes was; a job named twice is written
    /// twice, the same record (not sorted out here: a sort of the
    /// batch's names cost more than the copies it saved). The core calls
    /// this once per batch, before its commit.
    pub fn write_back(&self, fx: &mut Effects) {
        fx.writes.reserve(fx.dirty.len());
        for key in fx.dirty.drain(..) {
            if let Some(job) = self.jobs.record(key) {
                fx.writes.push(Write::PutJob(job));
            }
        }
    }
}

/// Tells `node` to cancel attempt `attempt` of job `job_id` (a no-op
/// there when that attempt no longer runs).
fn cancel_on(node: NodeName, job_id: String, attempt: u32, fx: &mut Effects) {
    fx.to_agents.push((
        node,
        ToAgent::Msg(DispatcherMessage {
            msg: Some(dispatcher_message::Msg::Cancel(Cancel { job_id, attempt })),
        }),
    ));
}

#[cfg(test)]
pub(crate) mod tests;

#[cfg(test)]
mod balance_tests;
#[cfg(test)]
mod domain_tests;
#[cfg(test)]
mod gang_tests;
#[cfg(test)]
mod gpu_tests;
#[cfg(test)]
mod latency_tests;
#[cfg(test)]
mod predict_tests;
#[cfg(test)]
mod retention_tests;

/// True when `job` ended with a run time its user's history counts: it
/// SUCCEEDED or FAILED after it started.
fn runtimes_count(job: &JobRecord) -> bool {
    matches!(
        JobState::try_from(job.state),
        Ok(JobState::Succeeded | JobState::Failed)
    ) && job.start_time_ms > 0
        && job.end_time_ms >= job.start_time_ms
}
