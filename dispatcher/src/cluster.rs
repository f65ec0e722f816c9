//! The cluster state and the job lifecycle: nodes (their topology, labels,
//! load, administrative state and a model of their CPUs), jobs, and the
//! node-level `sched` engine that places jobs (leaves = nodes, capacity =
//! CPUs, LLC level = rack, NUMA level = zone, SMT level = host group).
//!
//! Everything here is synchronous and does no I/O: each operation mutates
//! the state and appends what must happen outside to an [`Effects`] —
//! store writes, messages to agents, events for watchers — which the core
//! (`core.rs`) commits to the store *before* it acknowledges anything.
//!
//! Job states for users: PENDING (accepted, waiting for room: queued on a
//! node in the engine or matching no node yet), ASSIGNED (sent to its
//! node's agent), RUNNING (the agent started it), then SUCCEEDED / FAILED /
//! CANCELLED / LOST. In the engine a PENDING job queued on a node is a
//! waiting task (stealable by idle nodes of the rack), an ASSIGNED or
//! RUNNING job a running task.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use proto::v1::{
    Assign, Cancel, CpuGroup, DispatcherMessage, Job, JobEvent, JobSpec, JobState, JobStatus,
    ListJobsRequest, NodeLoad, NodeState, Register, dispatcher_message,
};
use sched::alloc::{find_aligned_in, free_summary_of};
use sched::topology::{DomainFlags, TopologyBuilder};
use sched::{
    FreeSummary, LeafId, LeafSet, Sched, SchedConfig, SchedEvent, TaskId, TaskSpec, TaskState,
    Topology,
};
use tonic::Status;

use crate::spec::{SpecLimits, align_of, check_batch, check_call, policy_of, validate};
use crate::store::{NodeAdmin, Snapshot, Write};

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
}

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
        Self {
            zone_label: "topology.kubernetes.io/zone".into(),
            rack_label: "dispatch.io/rack".into(),
            hostgroup_label: "dispatch.io/hostgroup".into(),
            region_label: "topology.kubernetes.io/region".into(),
            heartbeat_interval_ms: 1000,
            missed_heartbeats: 3,
            engine,
            limits: SpecLimits::default(),
        }
    }
}

/// What an operation requires of the outside world.
#[derive(Debug, Default)]
pub struct Effects {
    /// Store writes, committed before anything else is released.
    pub writes: Vec<Write>,
    /// Messages to agents, by node name.
    pub to_agents: Vec<(String, DispatcherMessage)>,
    /// Job events for watchers.
    pub events: Vec<JobEvent>,
}

/// A placement or a steal, kept for observers (the web page): the last
/// [`RECENT_MOVES`] of each, newest last.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Move {
    /// When (Unix ms).
    pub at_ms: i64,
    /// Job id.
    pub job: String,
    /// The node it left ("" for a placement of a pending job).
    pub from: String,
    /// The node it went to (for a job an agent gave back: where it was
    /// placed or queued again; "" when no node matches it now).
    pub to: String,
    /// For a placement, the job's reason (how the engine chose); for a
    /// steal, its level: `same rack`, `same zone`, `another zone`, or
    /// `agent gave it back` (the agent-level steal).
    pub why: String,
}

/// How many placements and steals [`Cluster`] keeps for observers.
pub const RECENT_MOVES: usize = 100;

/// A node as the dispatcher knows it.
#[derive(Clone, Debug)]
pub struct NodeInfo {
    /// Unique name.
    pub name: String,
    /// Labels.
    pub labels: HashMap<String, String>,
    /// Zone, rack, host group and region derived from labels.
    pub zone: String,
    /// Rack.
    pub rack: String,
    /// Host group ("" when unlabelled: the node is its own group).
    pub hostgroup: String,
    /// Region.
    pub region: String,
    /// The topology as reported.
    pub topology: proto::v1::Topology,
    /// The same, as an engine tree over CPU numbers (for alignment).
    pub cpu_topo: Arc<Topology>,
    /// The dispatcher's model of which CPUs its jobs hold (by dense CPU).
    pub cpu_busy: Vec<bool>,
    /// Memory offered to jobs.
    pub memory_bytes: u64,
    /// Runnable jobs per CPU the agent accepts (1 = no oversubscription).
    pub oversubscribe: u32,
    /// The last load report.
    pub load: NodeLoad,
    /// Administrative state.
    pub admin: NodeAdmin,
    /// The agent's stream is open.
    pub connected: bool,
    /// Marked down after missed heartbeats.
    pub down: bool,
    /// Last report time.
    pub last_heartbeat_ms: i64,
}

impl NodeInfo {
    /// Number of CPUs.
    pub fn nr_cpus(&self) -> u32 {
        self.topology.cpus.len() as u32
    }

    /// Capacity in the node-level engine: CPUs times the agent's
    /// oversubscription.
    pub fn slots(&self) -> u32 {
        self.nr_cpus().saturating_mul(self.oversubscribe.max(1))
    }

    /// The state shown to users.
    pub fn state(&self) -> NodeState {
        if self.down {
            NodeState::Down
        } else {
            match self.admin {
                NodeAdmin::Ready => NodeState::Ready,
                NodeAdmin::Cordoned => NodeState::Cordoned,
                NodeAdmin::Draining => NodeState::Draining,
            }
        }
    }

    fn schedulable(&self) -> bool {
        !self.down && self.connected && self.admin == NodeAdmin::Ready
    }

    /// Mark CPUs of the model busy for a job: the CPUs it reported, or
    /// (none reported yet) the aligned choice its agent will make.
    fn claim(&mut self, spec: &JobSpec, reported: Vec<LeafId>) -> Vec<LeafId> {
        let cpus = if reported.is_empty() {
            find_aligned_in(
                &self.cpu_topo,
                spec.cpus as usize,
                align_of(spec),
                policy_of(spec),
                None,
                |l| !self.cpu_busy[l],
            )
            .unwrap_or_default()
        } else {
            reported
        };
        for &c in &cpus {
            if let Some(b) = self.cpu_busy.get_mut(c) {
                *b = true;
            }
        }
        cpus
    }

    /// Mark CPUs of the model free again (a job ended or moved).
    fn release(&mut self, cpus: &[LeafId]) {
        for &c in cpus {
            if let Some(b) = self.cpu_busy.get_mut(c) {
                *b = false;
            }
        }
    }

    fn model_summary(&self) -> FreeSummary {
        free_summary_of(&self.cpu_topo, |l| !self.cpu_busy[l])
    }

    /// The proto view.
    pub fn to_proto(&self) -> proto::v1::Node {
        let topo = &self.topology;
        let cores = topo.smt.len() as u32;
        proto::v1::Node {
            name: self.name.clone(),
            labels: self.labels.clone(),
            topology: Some(topo.clone()),
            load: Some(self.load.clone()),
            state: self.state() as i32,
            last_heartbeat_ms: self.last_heartbeat_ms,
            sockets: topo.package.len() as u32,
            numa_nodes: topo.numa.len() as u32,
            llcs: topo.llc.len() as u32,
            cores,
            threads_per_core: (topo.cpus.len() as u32).checked_div(cores).unwrap_or(0),
            zone: self.zone.clone(),
            rack: self.rack.clone(),
        }
    }
}

/// A job and its dispatcher-side bookkeeping.
#[derive(Clone, Debug)]
struct JobEntry {
    job: Job,
    task: TaskId,
    /// CPUs the dispatcher's model gave it on its node (dense CPU indexes).
    model_cpus: Vec<LeafId>,
}

fn is_terminal(state: i32) -> bool {
    matches!(
        JobState::try_from(state),
        Ok(JobState::Succeeded | JobState::Failed | JobState::Cancelled | JobState::Lost)
    )
}

/// The engine's clock: nanoseconds (the dispatcher's is milliseconds), so
/// `avg_idle` and the steal cost compare in one unit.
fn engine_ns(now_ms: i64) -> u64 {
    (now_ms.max(0) as u64).saturating_mul(1_000_000)
}

/// Parse "j-12" / "j-12.3" into an ordering key.
fn job_key(id: &str) -> Option<(u64, u32)> {
    let rest = id.strip_prefix("j-")?;
    match rest.split_once('.') {
        None => Some((rest.parse().ok()?, 0)),
        Some((n, i)) => Some((n.parse().ok()?, i.parse::<u32>().ok()?.checked_add(1)?)),
    }
}

/// Build an engine tree over a node's CPUs from its reported topology.
pub fn cpu_topology(topo: &proto::v1::Topology) -> Result<Topology, String> {
    if topo.cpus.is_empty() {
        return Err("topology.cpus: empty".into());
    }
    let ids: Vec<u64> = topo.cpus.iter().map(|&c| c as u64).collect();
    let groups = |g: &[CpuGroup]| -> Vec<Vec<u64>> {
        g.iter()
            .map(|x| x.cpus.iter().map(|&c| c as u64).collect())
            .collect()
    };
    let mut b = TopologyBuilder::new(ids);
    for (name, flags, list) in [
        ("SMT", DomainFlags::SMT, &topo.smt),
        ("LLC", DomainFlags::LLC, &topo.llc),
        ("NUMA", DomainFlags::NUMA, &topo.numa),
        ("PKG", DomainFlags::PACKAGE, &topo.package),
    ] {
        if !list.is_empty() {
            b = b
                .level_from_groups(name, flags, &groups(list))
                .map_err(|e| format!("topology.{}: {e}", name.to_lowercase()))?;
        }
    }
    b.build().map_err(|e| format!("topology: {e}"))
}

/// The cluster.
pub struct Cluster {
    cfg: ClusterConfig,
    nodes: BTreeMap<String, NodeInfo>,
    /// Administrative states restored from the store for nodes that have
    /// not registered yet.
    restored_admin: HashMap<String, NodeAdmin>,
    /// Leaf of the engine -> node name, and back.
    leaf_node: Vec<String>,
    node_leaf: HashMap<String, LeafId>,
    engine: Option<Sched>,
    engine_dirty: bool,
    jobs: BTreeMap<(u64, u32), JobEntry>,
    task_job: HashMap<TaskId, (u64, u32)>,
    next_job: u64,
    next_task: u64,
    /// PENDING jobs not in the engine: no node matches them yet.
    unplaced: BTreeMap<(u64, u32), ()>,
    /// ASSIGNED/RUNNING jobs restored from the store whose node has not
    /// reported them yet, with the deadline after which they count as lost.
    awaiting_node: BTreeMap<(u64, u32), i64>,
    /// Jobs whose cancel was requested while on a node.
    cancelling: HashSet<(u64, u32)>,
    /// Terminal jobs whose engine task is kept (sleeping) so later jobs can
    /// name them as waker; oldest first, bounded.
    retained_tasks: std::collections::VecDeque<TaskId>,
    /// Engine trees of node topologies, by encoded topology.
    topo_cache: HashMap<Vec<u8>, Arc<Topology>>,
    /// ASSIGNED jobs (sent, not reported started) and when they were sent:
    /// candidates for agent-level stealing.
    assigned_at: BTreeMap<(u64, u32), i64>,
    /// Jobs an agent was asked to give back (Steal), and when.
    steal_requested: HashMap<(u64, u32), i64>,
    /// Per leaf: the largest aligned room of the whole (empty) node and its
    /// memory (u64::MAX when unknown).
    leaf_shape: Vec<(FreeSummary, u64)>,
    /// The smallest of each over all leaves.
    leaf_shape_min: (FreeSummary, u64),
    /// The last placements and steals (bounded rings), for observers.
    recent_placements: std::collections::VecDeque<Move>,
    recent_steals: std::collections::VecDeque<Move>,
}

/// Engine tasks of finished jobs kept for wake_wide / wake_affine history.
const RETAINED_TASKS: usize = 100_000;

fn now_state(job: &Job) -> JobState {
    JobState::try_from(job.state).unwrap_or(JobState::Unspecified)
}

impl Cluster {
    /// An empty cluster.
    pub fn new(cfg: ClusterConfig) -> Self {
        Self {
            cfg,
            nodes: BTreeMap::new(),
            restored_admin: HashMap::new(),
            leaf_node: Vec::new(),
            node_leaf: HashMap::new(),
            engine: None,
            engine_dirty: false,
            jobs: BTreeMap::new(),
            task_job: HashMap::new(),
            next_job: 1,
            next_task: 1,
            unplaced: BTreeMap::new(),
            awaiting_node: BTreeMap::new(),
            cancelling: HashSet::new(),
            retained_tasks: Default::default(),
            topo_cache: HashMap::new(),
            assigned_at: BTreeMap::new(),
            steal_requested: HashMap::new(),
            leaf_shape: Vec::new(),
            leaf_shape_min: (FreeSummary::default(), 0),
            recent_placements: Default::default(),
            recent_steals: Default::default(),
        }
    }

    /// The configuration.
    pub fn config(&self) -> &ClusterConfig {
        &self.cfg
    }

    /// Steals the node-level engine has made so far.
    pub fn steals(&self) -> u64 {
        self.engine.as_ref().map_or(0, |e| e.stats().steal)
    }

    /// Set the cost of a steal, measured by the caller (nanoseconds): a
    /// node steals only if its average idle period exceeds it (seed 000's
    /// SCHED_STEAL_COST, which the dispatcher measures instead of assuming).
    pub fn set_steal_cost(&mut self, ns: u64) {
        self.cfg.engine.steal_cost = ns;
        if let Some(engine) = self.engine.as_mut() {
            let mut c = engine.config().clone();
            c.steal_cost = ns;
            engine.set_config(c);
        }
    }

    /// The node-level engine (None until a node registers).
    pub fn engine(&self) -> Option<&Sched> {
        self.engine.as_ref()
    }

    /// The last placements (jobs sent to a node), oldest first.
    pub fn recent_placements(&self) -> impl DoubleEndedIterator<Item = &Move> {
        self.recent_placements.iter()
    }

    /// The last steals (queued jobs taken by idle nodes, and jobs agents
    /// gave back unstarted), oldest first.
    pub fn recent_steals(&self) -> impl DoubleEndedIterator<Item = &Move> {
        self.recent_steals.iter()
    }

    /// The node's leaf in the node-level engine (None before the engine
    /// includes it).
    pub fn engine_leaf(&self, node: &str) -> Option<LeafId> {
        if self.engine_dirty {
            return None;
        }
        self.node_leaf.get(node).copied()
    }

    fn record_move(ring: &mut std::collections::VecDeque<Move>, m: Move) {
        if ring.len() == RECENT_MOVES {
            ring.pop_front();
        }
        ring.push_back(m);
    }

    /// Number of jobs known (all states).
    pub fn nr_jobs(&self) -> usize {
        self.jobs.len()
    }

    /// Restore from a store snapshot (after a restart). PENDING jobs wait
    /// for nodes; ASSIGNED/RUNNING ones wait for their node to re-register
    /// and report them, until `now + grace_ms`.
    pub fn restore(&mut self, snap: Snapshot, now: i64, grace_ms: i64) {
        self.next_job = snap.next_job.max(1);
        self.restored_admin = snap.node_admin;
        for job in snap.jobs {
            let Some(key) = job_key(&job.id) else {
                continue;
            };
            match now_state(&job) {
                JobState::Pending | JobState::Unspecified => {
                    self.unplaced.insert(key, ());
                }
                JobState::Assigned | JobState::Running => {
                    self.awaiting_node.insert(key, now + grace_ms);
                    // Fix (found by tests/model.rs): the cancel request
                    // lived only in memory, so a restart forgot it and a
                    // lost node's retry ran the cancelled job again.
                    if job.cancel_requested {
                        self.cancelling.insert(key);
                    }
                }
                _ => {}
            }
            self.insert_job(key, job);
        }
    }

    fn new_task_id(&mut self) -> TaskId {
        let t = TaskId(self.next_task);
        self.next_task += 1;
        t
    }

    // ------------------------------------------------------------------
    // Queries

    /// One job by id.
    pub fn get_job(&self, id: &str) -> Result<Job, Status> {
        let key = job_key(id).ok_or_else(|| Status::not_found(format!("id: no job {id:?}")))?;
        match self.jobs.get(&key) {
            Some(e) => Ok(e.job.clone()),
            None if self.jobs.range((key.0, 1)..(key.0 + 1, 0)).next().is_some() => {
                Err(Status::not_found(format!(
                    "id: {id} is an array; its elements are {id}.0, {id}.1, ... (dispatchctl ls --array {id})"
                )))
            }
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
                Some(job_key(&req.page_token).ok_or_else(|| {
                    Status::invalid_argument("page_token: not a token from ListJobs")
                })?)
            };
        let states: HashSet<i32> = req.states.iter().copied().collect();
        let iter: Box<dyn Iterator<Item = (&(u64, u32), &JobEntry)>> = match upper {
            Some(u) => Box::new(self.jobs.range(..u).rev()),
            None => Box::new(self.jobs.iter().rev()),
        };
        let mut out = Vec::new();
        let mut next = String::new();
        for (_, e) in iter {
            let j = &e.job;
            if (!states.is_empty() && !states.contains(&j.state))
                || (!req.node.is_empty() && j.node != req.node)
                || (!req.group.is_empty() && j.spec.as_ref().is_none_or(|s| s.group != req.group))
                || (!req.array_id.is_empty() && j.array_id != req.array_id)
                || (!req.owner.is_empty() && j.owner != req.owner)
            {
                continue;
            }
            if out.len() == page {
                next = out.last().map(|j: &Job| j.id.clone()).unwrap_or_default();
                break;
            }
            out.push(j.clone());
        }
        Ok((out, next))
    }

    /// All jobs whose id is in `ids` (all jobs when empty), for watchers
    /// that want the current state first. An array's id matches its
    /// elements, as it does for the watch's later events.
    pub fn jobs_matching(&self, ids: &[String]) -> Vec<Job> {
        if ids.is_empty() {
            return self.jobs.values().map(|e| e.job.clone()).collect();
        }
        // Fix: an array id used to match nothing here (it is not a job of
        // its own), so `WatchJobs{ids: [array], include_current}` skipped
        // the elements' current states. Each job is sent once, in id order.
        let mut keys = std::collections::BTreeSet::new();
        for key in ids.iter().filter_map(|id| job_key(id)) {
            if self.jobs.contains_key(&key) {
                keys.insert(key);
            } else if key.1 == 0 {
                keys.extend(self.jobs.range((key.0, 1)..(key.0 + 1, 0)).map(|(k, _)| *k));
            }
        }
        keys.iter()
            .filter_map(|k| self.jobs.get(k).map(|e| e.job.clone()))
            .collect()
    }

    /// All nodes, by name.
    pub fn nodes(&self) -> impl Iterator<Item = &NodeInfo> {
        self.nodes.values()
    }

    /// One node.
    pub fn node(&self, name: &str) -> Result<&NodeInfo, Status> {
        self.nodes
            .get(name)
            .ok_or_else(|| Status::not_found(format!("name: no node {name:?}")))
    }

    /// Connected node names.
    pub fn connected_nodes(&self) -> Vec<String> {
        self.nodes
            .values()
            .filter(|n| n.connected)
            .map(|n| n.name.clone())
            .collect()
    }

    // ------------------------------------------------------------------
    // Submission and placement

    /// Accept jobs: validate every spec (nothing is created if one is
    /// bad), create the jobs (arrays expand), persist and place them.
    /// The jobs have no owner (a dispatcher without tokens).
    pub fn submit(
        &mut self,
        specs: Vec<JobSpec>,
        batch: bool,
        now: i64,
        fx: &mut Effects,
    ) -> Result<Vec<Job>, Status> {
        self.submit_as("", specs, batch, now, fx)
    }

    /// [`Cluster::submit`] for `owner` (the authenticated caller's user),
    /// recorded in each job and sent to its agent with the assignment.
    pub fn submit_as(
        &mut self,
        owner: &str,
        mut specs: Vec<JobSpec>,
        batch: bool,
        now: i64,
        fx: &mut Effects,
    ) -> Result<Vec<Job>, Status> {
        check_batch(&specs, &self.cfg.limits)?;
        for (i, spec) in specs.iter_mut().enumerate() {
            let prefix = if batch {
                format!("specs[{i}]")
            } else {
                "spec".to_string()
            };
            validate(spec, &prefix, &self.cfg.limits)?;
            if !spec.waker.is_empty() {
                let known = job_key(&spec.waker).is_some_and(|k| self.jobs.contains_key(&k));
                if !known {
                    return Err(Status::invalid_argument(format!(
                        "{prefix}.waker: no job {:?}",
                        spec.waker
                    )));
                }
            }
        }
        check_call(&specs, &self.cfg.limits)?;
        self.ensure_engine(now, fx);
        let mut created = Vec::new();
        for spec in specs {
            let n = self.next_job;
            self.next_job += 1;
            let count = spec.array_count;
            if count > 1 {
                for i in 0..count {
                    let key = (n, i + 1);
                    let job = Job {
                        id: format!("j-{n}.{i}"),
                        spec: Some(spec.clone()),
                        state: JobState::Pending as i32,
                        attempt: 1,
                        submit_time_ms: now,
                        array_id: format!("j-{n}"),
                        array_index: i,
                        owner: owner.to_string(),
                        ..Default::default()
                    };
                    created.push(key);
                    self.insert_job(key, job);
                }
            } else {
                let key = (n, 0);
                let job = Job {
                    id: format!("j-{n}"),
                    spec: Some(spec),
                    state: JobState::Pending as i32,
                    attempt: 1,
                    submit_time_ms: now,
                    owner: owner.to_string(),
                    ..Default::default()
                };
                created.push(key);
                self.insert_job(key, job);
            }
        }
        fx.writes.push(Write::PutNextJob(self.next_job));
        for &key in &created {
            self.persist(key, fx);
            self.emit(key, JobState::Unspecified, now, fx);
            self.place(key, now, fx);
        }
        self.process_events(now, fx);
        Ok(created
            .iter()
            .filter_map(|k| self.jobs.get(k).map(|e| e.job.clone()))
            .collect())
    }

    fn insert_job(&mut self, key: (u64, u32), job: Job) {
        let task = self.new_task_id();
        self.task_job.insert(task, key);
        self.jobs.insert(
            key,
            JobEntry {
                job,
                task,
                model_cpus: Vec::new(),
            },
        );
    }

    fn persist(&self, key: (u64, u32), fx: &mut Effects) {
        if let Some(e) = self.jobs.get(&key) {
            fx.writes.push(Write::PutJob(Box::new(e.job.clone())));
        }
    }

    fn emit(&self, key: (u64, u32), previous: JobState, now: i64, fx: &mut Effects) {
        if let Some(e) = self.jobs.get(&key) {
            fx.events.push(JobEvent {
                job: Some(e.job.clone()),
                previous_state: previous as i32,
                time_ms: now,
            });
        }
    }

    /// Nodes a spec may run on, as engine leaves; `Err(reason)` when none.
    fn allowed_leaves(&self, spec: &JobSpec) -> Result<Option<Arc<LeafSet>>, String> {
        let align = align_of(spec);
        // Fast path: no selector and every node is big enough.
        if spec.node_selector.is_empty()
            && spec.cpus <= self.leaf_shape_min.0.get(align)
            && (spec.memory_bytes == 0 || spec.memory_bytes <= self.leaf_shape_min.1)
        {
            return Ok(None);
        }
        let mut all = true;
        let mut leaves = Vec::new();
        for (leaf, name) in self.leaf_node.iter().enumerate() {
            let Some(n) = self.nodes.get(name) else {
                all = false;
                continue;
            };
            let (largest, memory) = self.leaf_shape[leaf];
            let fits_labels = spec
                .node_selector
                .iter()
                .all(|(k, v)| n.labels.get(k) == Some(v));
            let fits_mem = spec.memory_bytes == 0 || memory >= spec.memory_bytes;
            let fits_cpus = largest.get(align) >= spec.cpus;
            if fits_labels && fits_mem && fits_cpus {
                leaves.push(leaf);
            } else {
                all = false;
            }
        }
        if leaves.is_empty() {
            let mut why = Vec::new();
            if !spec.node_selector.is_empty() {
                why.push(format!("selector {:?}", spec.node_selector));
            }
            why.push(format!("{} CPUs aligned to {}", spec.cpus, align.name()));
            if spec.memory_bytes > 0 {
                why.push(format!("{} bytes of memory", spec.memory_bytes));
            }
            return Err(format!("no node matches {}", why.join(", ")));
        }
        if all {
            Ok(None)
        } else {
            Ok(Some(Arc::new(LeafSet::from_leaves(
                self.leaf_node.len(),
                leaves,
            ))))
        }
    }

    fn task_spec(&self, e: &JobEntry, affinity: Option<Arc<LeafSet>>) -> TaskSpec {
        let spec = e.job.spec.clone().unwrap_or_default();
        TaskSpec {
            id: e.task,
            nice: spec.nice,
            latency_nice: spec.latency_nice,
            demand: spec.cpus.max(1),
            affinity,
            policy: Some(policy_of(&spec)),
            align: align_of(&spec),
        }
    }

    /// Place a PENDING job: into the engine (which runs it on a node with
    /// room or queues it on one), or into `unplaced` when no node matches.
    fn place(&mut self, key: (u64, u32), now: i64, fx: &mut Effects) {
        let Some(e) = self.jobs.get(&key) else {
            return;
        };
        let spec = e.job.spec.clone().unwrap_or_default();
        let task = e.task;
        if self.engine.is_none() {
            self.set_pending_reason(key, "no nodes registered yet".into());
            self.unplaced.insert(key, ());
            return;
        }
        let allowed = match self.allowed_leaves(&spec) {
            Ok(a) => a,
            Err(reason) => {
                self.set_pending_reason(key, reason);
                self.unplaced.insert(key, ());
                self.persist(key, fx);
                return;
            }
        };
        self.unplaced.remove(&key);
        let tspec = self.task_spec(&self.jobs[&key], allowed);
        let waker = job_key(&spec.waker)
            .and_then(|k| self.jobs.get(&k))
            .map(|w| w.task)
            .filter(|t| self.engine.as_ref().is_some_and(|en| en.task(*t).is_some()));
        let Some(engine) = self.engine.as_mut() else {
            return;
        };
        if engine.task(task).is_some() {
            let _ = engine.remove_task(task, engine_ns(now));
        }
        if let Err(err) = engine.add_task(tspec) {
            self.set_pending_reason(key, format!("engine refused the job: {err}"));
            self.unplaced.insert(key, ());
            return;
        }
        let before = *engine.stats();
        let leaf = match engine.wake_up(task, waker, false, engine_ns(now)) {
            Ok(l) => l,
            Err(err) => {
                self.set_pending_reason(key, format!("engine refused the job: {err}"));
                return;
            }
        };
        let after = *engine.stats();
        let node = self.leaf_node.get(leaf).cloned().unwrap_or_default();
        let why = placement_reason(&before, &after, waker.is_some());
        let state = engine.task(task).map(|t| t.state);
        if let Some(e) = self.jobs.get_mut(&key) {
            let retry = e
                .job
                .reason
                .split(" | ")
                .find(|p| p.starts_with("retry ") || p.contains("gave it back"))
                .map(str::to_string);
            e.job.node = node.clone();
            e.job.reason = match state {
                Some(TaskState::Queued(_)) => format!("queued on {node} ({why}): no node has room"),
                _ => format!("{why} -> {node}"),
            };
            if let Some(retry) = retry {
                e.job.reason = format!("{retry} | {}", e.job.reason);
            }
        }
    }

    fn set_pending_reason(&mut self, key: (u64, u32), reason: String) {
        if let Some(e) = self.jobs.get_mut(&key) {
            e.job.reason = reason;
            e.job.node.clear();
        }
    }

    /// Turn engine events into job transitions and agent messages.
    fn process_events(&mut self, now: i64, fx: &mut Effects) {
        loop {
            let events = match self.engine.as_mut() {
                Some(e) => e.drain_events(),
                None => return,
            };
            if events.is_empty() {
                return;
            }
            for ev in events {
                match ev {
                    SchedEvent::Started { task, leaf } => self.on_started(task, leaf, now, fx),
                    SchedEvent::Migrated { task, from, to } => {
                        let (Some(from), Some(to)) = (
                            self.leaf_node.get(from).cloned(),
                            self.leaf_node.get(to).cloned(),
                        ) else {
                            continue;
                        };
                        let scope = self.move_scope(&from, &to);
                        if let Some(key) = self.task_job.get(&task).copied()
                            && let Some(e) = self.jobs.get_mut(&key)
                        {
                            e.job.node = to.clone();
                            e.job.reason =
                                format!("steal: {to} took it from overloaded {from} ({scope})");
                            let m = Move {
                                at_ms: now,
                                job: e.job.id.clone(),
                                from,
                                to,
                                why: scope.to_string(),
                            };
                            Self::record_move(&mut self.recent_steals, m);
                        }
                    }
                    SchedEvent::Preempted { .. } => {}
                }
            }
        }
    }

    fn move_scope(&self, from: &str, to: &str) -> &'static str {
        match (self.nodes.get(from), self.nodes.get(to)) {
            (Some(a), Some(b)) if a.zone == b.zone && a.rack == b.rack => "same rack",
            (Some(a), Some(b)) if a.zone == b.zone => "same zone",
            _ => "another zone",
        }
    }

    fn on_started(&mut self, task: TaskId, leaf: LeafId, now: i64, fx: &mut Effects) {
        let Some(key) = self.task_job.get(&task).copied() else {
            return;
        };
        let Some(name) = self.leaf_node.get(leaf).cloned() else {
            return;
        };
        let Some(e) = self.jobs.get(&key) else {
            return;
        };
        let st = now_state(&e.job);
        if st != JobState::Pending {
            // A job already on its node re-entering a rebuilt engine.
            return;
        }
        // Fix: events are drained after whole operations, so a Started
        // event may be stale: the task was started here, then preempted
        // (the node's capacity shrank) and placed elsewhere before the
        // event was read. Only the leaf the task runs on now counts;
        // acting on the stale event assigned the job to the wrong node.
        let running_here = self
            .engine
            .as_ref()
            .and_then(|en| en.task(task))
            .is_some_and(|t| t.state == TaskState::Running(leaf));
        if !running_here {
            return;
        }
        let spec = e.job.spec.clone().unwrap_or_default();
        // Model the CPUs the agent will give it.
        let cpus = match self.nodes.get_mut(&name) {
            Some(n) => n.claim(&spec, Vec::new()),
            None => Vec::new(),
        };
        self.sync_summary(&name, now);
        let Some(e) = self.jobs.get_mut(&key) else {
            return;
        };
        e.model_cpus = cpus;
        e.job.state = JobState::Assigned as i32;
        self.assigned_at.insert(key, now);
        if e.job.reason.contains("queued on ") && e.job.node == name {
            e.job.reason = format!("started on {name} when it had room; was {}", e.job.reason);
        }
        e.job.node = name.clone();
        let msg = DispatcherMessage {
            // The trace context is filled in by the core from the
            // job's telemetry after the batch (the cluster does no tracing).
            msg: Some(dispatcher_message::Msg::Assign(Assign {
                job_id: e.job.id.clone(),
                attempt: e.job.attempt,
                spec: e.job.spec.clone(),
                owner: e.job.owner.clone(),
                ..Default::default()
            })),
        };
        let placed = Move {
            at_ms: now,
            job: e.job.id.clone(),
            from: String::new(),
            to: name.clone(),
            why: e.job.reason.clone(),
        };
        Self::record_move(&mut self.recent_placements, placed);
        fx.to_agents.push((name, msg));
        self.persist(key, fx);
        self.emit(key, JobState::Pending, now, fx);
    }

    /// Push a node's modelled free summary into the engine.
    fn sync_summary(&mut self, name: &str, now: i64) {
        let (Some(n), Some(&leaf)) = (self.nodes.get(name), self.node_leaf.get(name)) else {
            return;
        };
        // An oversubscribed agent time-slices and aligns in its own queue:
        // only its slot count limits placement.
        let summary = (n.oversubscribe <= 1).then(|| n.model_summary());
        if let Some(engine) = self.engine.as_mut() {
            let _ = engine.set_free_summary(leaf, summary, engine_ns(now));
        }
    }

    /// The node's capacity as the engine should see it: its CPUs when it
    /// takes new jobs, else just what its jobs hold (so nothing new fits
    /// and nothing running is disturbed).
    fn effective_capacity(&self, name: &str) -> u32 {
        let Some(n) = self.nodes.get(name) else {
            return 0;
        };
        if n.schedulable() {
            return n.slots();
        }
        self.jobs
            .values()
            .filter(|e| {
                e.job.node == name
                    && matches!(now_state(&e.job), JobState::Assigned | JobState::Running)
            })
            .map(|e| e.job.spec.as_ref().map_or(1, |s| s.cpus.max(1)))
            .sum()
    }

    fn refresh_capacity(&mut self, name: &str, now: i64, fx: &mut Effects) {
        let cap = self.effective_capacity(name);
        let Some(&leaf) = self.node_leaf.get(name) else {
            return;
        };
        let schedulable = self.nodes.get(name).is_some_and(NodeInfo::schedulable);
        if let Some(engine) = self.engine.as_mut() {
            let _ = engine.set_capacity(leaf, cap, engine_ns(now));
        }
        if !schedulable {
            // Jobs queued here cannot start: place them again elsewhere.
            let queued: Vec<TaskId> = self
                .engine
                .as_ref()
                .map_or(Vec::new(), |e| e.rq(leaf).waiting().collect());
            for task in queued {
                if let Some(key) = self.task_job.get(&task).copied() {
                    if let Some(engine) = self.engine.as_mut() {
                        let _ = engine.block(task, engine_ns(now));
                    }
                    self.place(key, now, fx);
                }
            }
        }
        self.process_events(now, fx);
    }

    // ------------------------------------------------------------------
    // The engine over the node set

    fn ensure_engine(&mut self, now: i64, fx: &mut Effects) {
        if self.engine_dirty {
            self.engine_dirty = false;
            self.rebuild_engine(now, fx);
        }
    }

    /// Build the node-level engine for the current node set and put every
    /// job that is on a node back into it.
    fn rebuild_engine(&mut self, now: i64, fx: &mut Effects) {
        if self.nodes.is_empty() {
            self.engine = None;
            self.leaf_node.clear();
            self.node_leaf.clear();
            return;
        }
        let mut order: Vec<&NodeInfo> = self.nodes.values().collect();
        order.sort_by(|a, b| {
            (&a.region, &a.zone, &a.rack, &a.hostgroup, &a.name).cmp(&(
                &b.region,
                &b.zone,
                &b.rack,
                &b.hostgroup,
                &b.name,
            ))
        });
        let mut intern: HashMap<String, u64> = HashMap::new();
        let mut key = |s: String| -> u64 {
            let next = intern.len() as u64;
            *intern.entry(s).or_insert(next)
        };
        let n = order.len();
        let (mut hg, mut rack, mut zone, mut region) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let has_hostgroups = order.iter().any(|x| !x.hostgroup.is_empty());
        for x in &order {
            let hgname = if x.hostgroup.is_empty() {
                format!("node:{}", x.name)
            } else {
                x.hostgroup.clone()
            };
            hg.push(key(format!(
                "h\0{}\0{}\0{}\0{}",
                x.region, x.zone, x.rack, hgname
            )));
            rack.push(key(format!("r\0{}\0{}\0{}", x.region, x.zone, x.rack)));
            zone.push(key(format!("z\0{}\0{}", x.region, x.zone)));
            region.push(key(format!("g\0{}", x.region)));
        }
        let mut b = TopologyBuilder::new((0..n as u64).collect());
        if has_hostgroups {
            b = b.level("hostgroup", DomainFlags::SMT, hg);
        }
        let topo = match b
            .level("rack", DomainFlags::LLC, rack)
            .level("zone", DomainFlags::NUMA, zone)
            .level("region", DomainFlags::PACKAGE, region)
            .build()
        {
            Ok(t) => Arc::new(t),
            Err(err) => {
                tracing::error!(%err, "cannot build the cluster topology");
                return;
            }
        };
        self.leaf_node = order.iter().map(|x| x.name.clone()).collect();
        self.node_leaf = self
            .leaf_node
            .iter()
            .enumerate()
            .map(|(i, n)| (n.clone(), i))
            .collect();
        self.leaf_shape = self
            .leaf_node
            .iter()
            .map(|name| match self.nodes.get(name) {
                Some(n) => (
                    free_summary_of(&n.cpu_topo, |_| true),
                    if n.memory_bytes == 0 {
                        u64::MAX
                    } else {
                        n.memory_bytes
                    },
                ),
                None => (FreeSummary::default(), 0),
            })
            .collect();
        let mut min = (
            FreeSummary {
                core: u32::MAX,
                llc: u32::MAX,
                numa: u32::MAX,
                package: u32::MAX,
                any: u32::MAX,
            },
            u64::MAX,
        );
        for (f, m) in &self.leaf_shape {
            min.0 = FreeSummary {
                core: min.0.core.min(f.core),
                llc: min.0.llc.min(f.llc),
                numa: min.0.numa.min(f.numa),
                package: min.0.package.min(f.package),
                any: min.0.any.min(f.any),
            };
            min.1 = min.1.min(*m);
        }
        self.leaf_shape_min = min;
        let caps: Vec<u32> = self
            .leaf_node
            .iter()
            .map(|n| self.nodes.get(n).map_or(0, NodeInfo::slots))
            .collect();
        let engine = Sched::with_capacities(topo, &caps, self.cfg.engine.clone());
        // Jobs on nodes first (they hold capacity), then queued ones.
        let mut on_nodes = Vec::new();
        let mut queued = Vec::new();
        for (&key, e) in &self.jobs {
            if self.awaiting_node.contains_key(&key) || self.unplaced.contains_key(&key) {
                continue;
            }
            match now_state(&e.job) {
                JobState::Assigned | JobState::Running => on_nodes.push(key),
                JobState::Pending => queued.push(key),
                _ => {}
            }
        }
        self.engine = Some(engine);
        for key in on_nodes {
            let Some(e) = self.jobs.get(&key) else {
                continue;
            };
            let Some(&leaf) = self.node_leaf.get(&e.job.node) else {
                continue;
            };
            let tspec = self.task_spec(e, None);
            let task = e.task;
            if let Some(engine) = self.engine.as_mut()
                && engine.add_task(tspec).is_ok()
            {
                let _ = engine.wake_up_on(task, leaf, engine_ns(now));
            }
        }
        // Started events of jobs already on nodes are ignored by on_started.
        self.process_events(now, fx);
        let names: Vec<String> = self.leaf_node.clone();
        for name in &names {
            let cap = self.effective_capacity(name);
            if let (Some(engine), Some(&leaf)) = (self.engine.as_mut(), self.node_leaf.get(name)) {
                let _ = engine.set_capacity(leaf, cap, engine_ns(now));
            }
            self.sync_summary(name, now);
        }
        for key in queued {
            self.place(key, now, fx);
        }
        let unplaced: Vec<(u64, u32)> = self.unplaced.keys().copied().collect();
        for key in unplaced {
            self.place(key, now, fx);
        }
        self.process_events(now, fx);
    }

    // ------------------------------------------------------------------
    // Agents

    /// An agent registers (or re-registers after a reconnect).
    pub fn register(&mut self, reg: Register, now: i64, fx: &mut Effects) -> Result<u64, Status> {
        if reg.node.is_empty() {
            return Err(Status::invalid_argument("register.node: empty"));
        }
        // Found by tests/faults_fuzz.rs: a huge value overflowed the
        // node's slots and stopped the core.
        if reg.oversubscribe > MAX_OVERSUBSCRIBE {
            return Err(Status::invalid_argument(format!(
                "register.oversubscribe: {} jobs per CPU, at most {MAX_OVERSUBSCRIBE}",
                reg.oversubscribe
            )));
        }
        let topology = reg
            .topology
            .clone()
            .ok_or_else(|| Status::invalid_argument("register.topology: missing"))?;
        // Fleets are mostly identical machines: share one engine tree per
        // distinct topology.
        let shape = prost::Message::encode_to_vec(&topology);
        let cpu_topo = match self.topo_cache.get(&shape) {
            Some(t) => t.clone(),
            None => {
                let t = Arc::new(
                    cpu_topology(&topology)
                        .map_err(|e| Status::invalid_argument(format!("register.{e}")))?,
                );
                self.topo_cache.insert(shape, t.clone());
                t
            }
        };
        let label = |k: &str, default: &str| {
            reg.labels
                .get(k)
                .cloned()
                .unwrap_or_else(|| default.to_string())
        };
        let zone = label(&self.cfg.zone_label, "default");
        let rack = label(&self.cfg.rack_label, "default");
        let hostgroup = label(&self.cfg.hostgroup_label, "");
        let region = label(&self.cfg.region_label, "default");
        let admin = self
            .nodes
            .get(&reg.node)
            .map(|n| n.admin)
            .or_else(|| self.restored_admin.get(&reg.node).copied())
            .unwrap_or(NodeAdmin::Ready);
        let changed = match self.nodes.get(&reg.node) {
            None => true,
            Some(old) => {
                old.oversubscribe != reg.oversubscribe.max(1)
                    || old.topology != topology
                    || old.zone != zone
                    || old.rack != rack
                    || old.hostgroup != hostgroup
                    || old.region != region
            }
        };
        let nr = cpu_topo.nr_leaves();
        let node = NodeInfo {
            name: reg.node.clone(),
            labels: reg.labels.clone(),
            zone,
            rack,
            hostgroup,
            region,
            topology,
            cpu_topo,
            cpu_busy: vec![false; nr],
            memory_bytes: reg.memory_bytes,
            oversubscribe: reg.oversubscribe.max(1),
            load: NodeLoad::default(),
            admin,
            connected: true,
            down: false,
            last_heartbeat_ms: now,
        };
        let old = self.nodes.insert(reg.node.clone(), node);
        // Re-mark CPUs held by jobs the dispatcher has on this node.
        let held: Vec<(u64, u32)> = self
            .jobs
            .iter()
            .filter(|(_, e)| {
                e.job.node == reg.node
                    && matches!(now_state(&e.job), JobState::Assigned | JobState::Running)
            })
            .map(|(k, _)| *k)
            .collect();
        for key in &held {
            self.remodel_cpus(*key);
        }
        if changed {
            self.engine_dirty = true;
        }
        // Reconcile what the agent reports with what we believe.
        // By attempt: a stale attempt still running there must not hide
        // that the current one is missing (found by tests/model.rs: the
        // current attempt's Assign was then never re-sent).
        let reported: HashSet<(String, u32)> = reg
            .jobs
            .iter()
            .map(|s| (s.job_id.clone(), s.attempt))
            .collect();
        for status in reg.jobs {
            let key = job_key(&status.job_id);
            let ours = key.and_then(|k| self.jobs.get(&k)).map(|e| {
                (
                    e.job.attempt == status.attempt && (e.job.node == reg.node),
                    is_terminal(e.job.state),
                )
            });
            match ours {
                Some((true, false)) => {
                    if let Some(k) = key {
                        self.awaiting_node.remove(&k);
                        if !self.engine_dirty {
                            self.engine_add_on_node(k, now);
                        }
                        // The Cancel may have been lost with the old
                        // stream or a dispatcher crash: send it again.
                        if self.cancelling.contains(&k) && !is_terminal(status.state) {
                            cancel_on(reg.node.clone(), status.job_id.clone(), status.attempt, fx);
                        }
                    }
                    self.apply_status(&reg.node, status, now, fx);
                }
                _ => {
                    // Unknown, stale attempt, or already finished here: make
                    // sure it does not run twice.
                    if matches!(
                        JobState::try_from(status.state),
                        Ok(JobState::Running | JobState::Assigned)
                    ) {
                        cancel_on(reg.node.clone(), status.job_id.clone(), status.attempt, fx);
                    }
                }
            }
        }
        // Jobs we had on this node that the agent no longer knows.
        if old.is_some() || !reported.is_empty() || !held.is_empty() {
            for key in held {
                let Some(e) = self.jobs.get(&key) else {
                    continue;
                };
                if reported.contains(&(e.job.id.clone(), e.job.attempt)) || is_terminal(e.job.state)
                {
                    continue;
                }
                if self.cancelling.contains(&key) {
                    // Cancelled while on this node, which no longer runs
                    // it: done, never re-sent.
                    self.awaiting_node.remove(&key);
                    if let Some(e) = self.jobs.get_mut(&key) {
                        e.job.reason = format!("cancelled by user; {} no longer had it", reg.node);
                    }
                    self.finish(key, JobState::Cancelled, now, fx);
                } else if now_state(&e.job) == JobState::Assigned {
                    // The Assign may have been lost with the old stream or a
                    // dispatcher crash: resend (the agent ignores duplicates).
                    if self.awaiting_node.remove(&key).is_some() && !self.engine_dirty {
                        self.engine_add_on_node(key, now);
                    }
                    let Some(e) = self.jobs.get(&key) else {
                        continue;
                    };
                    fx.to_agents.push((
                        reg.node.clone(),
                        DispatcherMessage {
                            msg: Some(dispatcher_message::Msg::Assign(Assign {
                                job_id: e.job.id.clone(),
                                attempt: e.job.attempt,
                                spec: e.job.spec.clone(),
                                owner: e.job.owner.clone(),
                                ..Default::default()
                            })),
                        },
                    ));
                } else {
                    self.awaiting_node.remove(&key);
                    self.job_lost_on_node(key, "its agent restarted without it", now, fx);
                }
            }
        }
        if !self.engine_dirty {
            // A known node re-registered: no new tree needed.
            self.refresh_capacity(&reg.node, now, fx);
            self.sync_summary(&reg.node, now);
            self.retry_unplaced(now, fx);
            self.process_events(now, fx);
        }
        // Otherwise the tree is rebuilt once by `settle` (the core calls it
        // after every batch), so a thousand agents registering at once
        // cost one rebuild, not a thousand.
        Ok(self.cfg.heartbeat_interval_ms)
    }

    /// Apply deferred work (a rebuilt node tree after registrations, which
    /// also places waiting jobs). The core calls it after every batch.
    pub fn settle(&mut self, now: i64, fx: &mut Effects) {
        self.ensure_engine(now, fx);
    }

    fn engine_add_on_node(&mut self, key: (u64, u32), now: i64) {
        let Some(e) = self.jobs.get(&key) else { return };
        let Some(&leaf) = self.node_leaf.get(&e.job.node) else {
            return;
        };
        let tspec = self.task_spec(e, None);
        let task = e.task;
        if let Some(engine) = self.engine.as_mut() {
            if engine.task(task).is_none() && engine.add_task(tspec).is_err() {
                return;
            }
            if engine
                .task(task)
                .is_some_and(|t| t.state == TaskState::Sleeping)
            {
                let _ = engine.wake_up_on(task, leaf, engine_ns(now));
            }
        }
    }

    /// Mark a job's modelled CPUs on its node from the CPUs it reported (or
    /// a fresh aligned choice when it reported none).
    fn remodel_cpus(&mut self, key: (u64, u32)) {
        let Some(e) = self.jobs.get(&key) else { return };
        let Some(n) = self.nodes.get_mut(&e.job.node) else {
            return;
        };
        let spec = e.job.spec.clone().unwrap_or_default();
        n.release(&e.model_cpus);
        let reported: Vec<LeafId> = e
            .job
            .cpus
            .iter()
            .filter_map(|&c| n.cpu_topo.leaf_of_os_id(c as u64))
            .collect();
        let cpus = n.claim(&spec, reported);
        if let Some(e) = self.jobs.get_mut(&key) {
            e.model_cpus = cpus;
        }
    }

    /// A load report (the heartbeat). A node marked DOWN whose stream
    /// stayed open (it stalled, then recovered) is back: its jobs were
    /// already retried or lost, and anything it still runs from before is
    /// cancelled when it reports it.
    pub fn load_report(&mut self, node: &str, load: NodeLoad, now: i64, fx: &mut Effects) {
        let mut revived = false;
        if let Some(n) = self.nodes.get_mut(node) {
            n.load = load;
            n.last_heartbeat_ms = now;
            if n.down && n.connected {
                n.down = false;
                revived = true;
            }
        }
        if revived {
            tracing::info!(%node, "node reports again: it is up");
            self.ensure_engine(now, fx);
            self.refresh_capacity(node, now, fx);
            self.sync_summary(node, now);
            self.retry_unplaced(now, fx);
            self.process_events(now, fx);
        }
    }

    /// Any message from an agent proves it alive.
    pub fn load_report_time(&mut self, node: &str, now: i64) {
        if let Some(n) = self.nodes.get_mut(node) {
            n.last_heartbeat_ms = now;
        }
    }

    /// A job status from an agent.
    pub fn job_status(&mut self, node: &str, status: JobStatus, now: i64, fx: &mut Effects) {
        self.ensure_engine(now, fx);
        let key = job_key(&status.job_id);
        let current = key
            .and_then(|k| self.jobs.get(&k))
            .map(|e| (e.job.attempt, e.job.node.clone(), e.job.state));
        match current {
            Some((attempt, ref n, state))
                if attempt == status.attempt && n == node && !is_terminal(state) =>
            {
                self.apply_status(node, status, now, fx);
                self.process_events(now, fx);
            }
            _ => {
                if matches!(JobState::try_from(status.state), Ok(JobState::Running)) {
                    cancel_on(node.to_string(), status.job_id, status.attempt, fx);
                }
            }
        }
    }

    fn apply_status(&mut self, node: &str, status: JobStatus, now: i64, fx: &mut Effects) {
        let Some(key) = job_key(&status.job_id) else {
            return;
        };
        let Some(e) = self.jobs.get(&key) else { return };
        let previous = now_state(&e.job);
        match JobState::try_from(status.state).unwrap_or(JobState::Unspecified) {
            JobState::Running => {
                self.assigned_at.remove(&key);
                self.steal_requested.remove(&key);
                if let Some(e) = self.jobs.get_mut(&key) {
                    e.job.state = JobState::Running as i32;
                    e.job.cpus = status.cpus.clone();
                    if e.job.start_time_ms == 0 {
                        e.job.start_time_ms = if status.time_ms > 0 {
                            status.time_ms
                        } else {
                            now
                        };
                    }
                }
                self.remodel_cpus(key);
                self.sync_summary(node, now);
                if previous != JobState::Running {
                    self.persist(key, fx);
                    self.emit(key, previous, now, fx);
                }
            }
            JobState::Assigned => {}
            terminal @ (JobState::Succeeded
            | JobState::Failed
            | JobState::Cancelled
            | JobState::Lost) => {
                if let Some(e) = self.jobs.get_mut(&key) {
                    e.job.exit_code = status.exit_code;
                    e.job.signal = status.signal;
                    if !status.cpus.is_empty() {
                        e.job.cpus = status.cpus.clone();
                    }
                    if e.job.start_time_ms == 0 && status.time_ms > 0 {
                        e.job.start_time_ms = status.time_ms;
                    }
                    if !status.message.is_empty() {
                        e.job.reason = status.message.clone();
                    }
                }
                self.finish(key, terminal, now, fx);
            }
            JobState::Pending | JobState::Unspecified => {}
        }
    }

    /// Put a job in a terminal state: free its CPUs and its engine
    /// capacity (which may start or steal queued jobs), persist, announce.
    fn finish(&mut self, key: (u64, u32), state: JobState, now: i64, fx: &mut Effects) {
        let Some(e) = self.jobs.get_mut(&key) else {
            return;
        };
        let previous = now_state(&e.job);
        if is_terminal(e.job.state) {
            return;
        }
        e.job.state = state as i32;
        e.job.end_time_ms = now;
        let node = e.job.node.clone();
        let task = e.task;
        let cpus = std::mem::take(&mut e.model_cpus);
        self.cancelling.remove(&key);
        self.unplaced.remove(&key);
        self.awaiting_node.remove(&key);
        self.assigned_at.remove(&key);
        self.steal_requested.remove(&key);
        if let Some(n) = self.nodes.get_mut(&node) {
            n.release(&cpus);
        }
        if let Some(engine) = self.engine.as_mut()
            && engine.task(task).is_some()
        {
            let _ = engine.block(task, engine_ns(now));
            self.retained_tasks.push_back(task);
            while self.retained_tasks.len() > RETAINED_TASKS {
                if let Some(old) = self.retained_tasks.pop_front() {
                    let _ = engine.remove_task(old, engine_ns(now));
                }
            }
        }
        self.persist(key, fx);
        self.emit(key, previous, now, fx);
        if !node.is_empty() && self.node_leaf.contains_key(&node) {
            let schedulable = self.nodes.get(&node).is_some_and(NodeInfo::schedulable);
            if !schedulable {
                self.refresh_capacity(&node, now, fx);
            }
            self.sync_summary(&node, now);
        }
        self.process_events(now, fx);
    }

    /// The agent's stream closed. The node stays up until its heartbeats
    /// are overdue, so a quick reconnect loses nothing.
    pub fn disconnected(&mut self, node: &str) {
        if let Some(n) = self.nodes.get_mut(node) {
            n.connected = false;
        }
    }

    /// A job on a lost node: retry it within its budget, else LOST.
    fn job_lost_on_node(&mut self, key: (u64, u32), why: &str, now: i64, fx: &mut Effects) {
        let Some(e) = self.jobs.get(&key) else { return };
        if is_terminal(e.job.state) {
            return;
        }
        if self.cancelling.contains(&key) {
            self.finish(key, JobState::Cancelled, now, fx);
            return;
        }
        let retries = e.job.spec.as_ref().map_or(0, |s| s.retries);
        let node = e.job.node.clone();
        // The node may only be stalled with its stream still open (a
        // paused agent, a partition that keeps the TCP connection): tell
        // it to cancel this attempt, so the copy stops as soon as the node
        // reads its stream again instead of running beside the retry until
        // it reports. A disconnected node gets it when it re-registers
        // (the stale attempt is cancelled there).
        if !node.is_empty() {
            cancel_on(node.clone(), e.job.id.clone(), e.job.attempt, fx);
        }
        if e.job.attempt <= retries {
            let previous = now_state(&e.job);
            let task = e.task;
            if let Some(n) = self.nodes.get_mut(&node) {
                n.release(&e.model_cpus);
            }
            if let Some(engine) = self.engine.as_mut()
                && engine.task(task).is_some()
            {
                let _ = engine.remove_task(task, engine_ns(now));
            }
            self.assigned_at.remove(&key);
            self.steal_requested.remove(&key);
            if let Some(e) = self.jobs.get_mut(&key) {
                e.model_cpus.clear();
                e.job.attempt += 1;
                e.job.state = JobState::Pending as i32;
                e.job.cpus.clear();
                e.job.start_time_ms = 0;
                e.job.reason = format!(
                    "retry {} of {retries}: node {node} lost ({why})",
                    e.job.attempt - 1
                );
                e.job.node.clear();
            }
            // Fix: shrink the lost node's engine capacity to what its
            // remaining jobs hold *before* placing the retry. Removing the
            // task freed capacity on that node, so the engine could start
            // the retry right back on the DOWN node (found end to end:
            // tests/cluster.rs, a killed agent's job ASSIGNED to it again).
            if !self.nodes.get(&node).is_some_and(NodeInfo::schedulable) {
                self.refresh_capacity(&node, now, fx);
            }
            self.persist(key, fx);
            self.emit(key, previous, now, fx);
            self.place(key, now, fx);
        } else {
            if let Some(e) = self.jobs.get_mut(&key) {
                e.job.reason = format!("node {node} lost ({why}), no retries left");
            }
            self.finish(key, JobState::Lost, now, fx);
        }
    }

    /// Periodic work: overdue heartbeats make nodes DOWN, restored jobs
    /// whose node never came back are lost, busy flags are set lazily.
    pub fn tick(&mut self, now: i64, fx: &mut Effects) {
        self.ensure_engine(now, fx);
        let deadline = (self.cfg.heartbeat_interval_ms * self.cfg.missed_heartbeats) as i64;
        let overdue: Vec<String> = self
            .nodes
            .values()
            .filter(|n| !n.down && now - n.last_heartbeat_ms > deadline)
            .map(|n| n.name.clone())
            .collect();
        // Fix (found by tests/model.rs): mark every overdue node DOWN and
        // shrink its engine capacity before retrying any job, or a retry
        // from the first lost node could be assigned to a second one that
        // this same tick then marks DOWN.
        for name in &overdue {
            tracing::warn!(node = %name, "node missed its heartbeats: marking it down");
            if let Some(n) = self.nodes.get_mut(name) {
                n.down = true;
            }
        }
        for name in &overdue {
            let cap = self.effective_capacity(name);
            if let (Some(&leaf), Some(engine)) = (self.node_leaf.get(name), self.engine.as_mut()) {
                let _ = engine.set_capacity(leaf, cap, engine_ns(now));
            }
        }
        for name in overdue {
            let on_node: Vec<(u64, u32)> = self
                .jobs
                .iter()
                .filter(|(_, e)| {
                    e.job.node == name
                        && matches!(now_state(&e.job), JobState::Assigned | JobState::Running)
                })
                .map(|(k, _)| *k)
                .collect();
            for key in on_node {
                self.job_lost_on_node(key, "missed heartbeats", now, fx);
            }
            self.refresh_capacity(&name, now, fx);
        }
        let expired: Vec<(u64, u32)> = self
            .awaiting_node
            .iter()
            .filter(|&(_, &d)| d <= now)
            .map(|(k, _)| *k)
            .collect();
        for key in expired {
            self.awaiting_node.remove(&key);
            self.job_lost_on_node(
                key,
                "its node did not come back after a dispatcher restart",
                now,
                fx,
            );
        }
        if let Some(engine) = self.engine.as_mut() {
            for leaf in 0..engine.topology().nr_leaves() {
                engine.tick(leaf, engine_ns(now));
            }
        }
        self.process_events(now, fx);
        self.request_agent_steals(now, fx);
    }

    /// Idle stealing one level down: a job sent to an agent that has not
    /// started it (an oversubscribed agent holds it in its own queue, e.g.
    /// a gang waiting for aligned CPUs) is asked back (`Steal`) when a node
    /// of the same rack has room for it, the seed's steal across the
    /// dispatcher/agent boundary. At most one request per idle node per
    /// tick; the agent answers with `StealReply`.
    fn request_agent_steals(&mut self, now: i64, fx: &mut Effects) {
        let grace = self.cfg.heartbeat_interval_ms as i64;
        // Most ticks find no job held unstarted past the grace period:
        // check that first, before indexing the idle nodes (O(nodes)).
        if !self
            .assigned_at
            .iter()
            .any(|(key, &at)| now - at >= grace && !self.steal_requested.contains_key(key))
        {
            return;
        }
        let Some(engine) = self.engine.as_ref() else {
            return;
        };
        let mut idle_by_rack: HashMap<(String, String), Vec<u32>> = HashMap::new();
        for (leaf, name) in self.leaf_node.iter().enumerate() {
            let Some(n) = self.nodes.get(name) else {
                continue;
            };
            let room = engine.rq(leaf).room(sched::Align::Any);
            if n.schedulable() && room > 0 {
                idle_by_rack
                    .entry((n.zone.clone(), n.rack.clone()))
                    .or_default()
                    .push(room);
            }
        }
        if idle_by_rack.is_empty() {
            return;
        }
        let mut requests = Vec::new();
        for (&key, &at) in &self.assigned_at {
            if now - at < grace || self.steal_requested.contains_key(&key) {
                continue;
            }
            let Some(e) = self.jobs.get(&key) else {
                continue;
            };
            let Some(n) = self.nodes.get(&e.job.node) else {
                continue;
            };
            let cpus = e.job.spec.as_ref().map_or(1, |s| s.cpus.max(1));
            let Some(rooms) = idle_by_rack.get_mut(&(n.zone.clone(), n.rack.clone())) else {
                continue;
            };
            if let Some(pos) = rooms.iter().position(|&r| r >= cpus) {
                rooms.swap_remove(pos);
                requests.push((key, e.job.node.clone(), e.job.id.clone(), e.job.attempt));
            }
        }
        for (key, node, job_id, attempt) in requests {
            self.steal_requested.insert(key, now);
            fx.to_agents.push((
                node,
                DispatcherMessage {
                    msg: Some(dispatcher_message::Msg::Steal(proto::v1::Steal {
                        job_id,
                        attempt,
                    })),
                },
            ));
        }
    }

    /// An agent's answer to `Steal`: a released job is placed again (on
    /// the node with room, normally).
    pub fn steal_reply(
        &mut self,
        node: &str,
        reply: proto::v1::StealReply,
        now: i64,
        fx: &mut Effects,
    ) {
        let Some(key) = job_key(&reply.job_id) else {
            return;
        };
        self.steal_requested.remove(&key);
        if !reply.released {
            return;
        }
        let Some(e) = self.jobs.get(&key) else { return };
        if e.job.attempt != reply.attempt
            || e.job.node != node
            || now_state(&e.job) != JobState::Assigned
        {
            return;
        }
        let task = e.task;
        let cpus = e.model_cpus.clone();
        self.ensure_engine(now, fx);
        self.assigned_at.remove(&key);
        if let Some(n) = self.nodes.get_mut(node) {
            n.release(&cpus);
        }
        if let Some(engine) = self.engine.as_mut() {
            let _ = engine.remove_task(task, engine_ns(now));
        }
        if self.cancelling.contains(&key) {
            // Fix (found by tests/model.rs): a job cancelled while its
            // node held it unstarted was placed again when the node gave
            // it back. Given back unstarted, it runs nowhere: it is done.
            if let Some(e) = self.jobs.get_mut(&key) {
                e.model_cpus.clear();
                e.job.reason = format!("cancelled by user; {node} gave it back unstarted");
            }
            self.sync_summary(node, now);
            self.finish(key, JobState::Cancelled, now, fx);
            return;
        }
        if let Some(e) = self.jobs.get_mut(&key) {
            e.model_cpus.clear();
            e.job.state = JobState::Pending as i32;
            e.job.node.clear();
            e.job.reason =
                format!("steal: {node} gave it back unstarted (an idle rack peer had room)");
        }
        self.persist(key, fx);
        self.emit(key, JobState::Assigned, now, fx);
        self.sync_summary(node, now);
        self.place(key, now, fx);
        self.process_events(now, fx);
        let m = Move {
            at_ms: now,
            job: reply.job_id,
            from: node.to_string(),
            to: self
                .jobs
                .get(&key)
                .map(|e| e.job.node.clone())
                .unwrap_or_default(),
            why: "agent gave it back".into(),
        };
        Self::record_move(&mut self.recent_steals, m);
    }

    fn retry_unplaced(&mut self, now: i64, fx: &mut Effects) {
        let keys: Vec<(u64, u32)> = self.unplaced.keys().copied().collect();
        for key in keys {
            self.place(key, now, fx);
            self.persist(key, fx);
        }
    }

    // ------------------------------------------------------------------
    // Users' actions

    /// Cancel a job, or every element of an array.
    pub fn cancel(&mut self, id: &str, now: i64, fx: &mut Effects) -> Result<Job, Status> {
        self.ensure_engine(now, fx);
        let key = job_key(id).ok_or_else(|| Status::not_found(format!("id: no job {id:?}")))?;
        if !self.jobs.contains_key(&key) && key.1 == 0 {
            let elements: Vec<(u64, u32)> = self
                .jobs
                .range((key.0, 1)..(key.0 + 1, 0))
                .map(|(k, _)| *k)
                .collect();
            if elements.is_empty() {
                return Err(Status::not_found(format!("id: no job {id:?}")));
            }
            for k in &elements {
                self.cancel_one(*k, now, fx);
            }
            let first = self
                .jobs
                .get(&elements[0])
                .map(|e| e.job.clone())
                .unwrap_or_default();
            return Ok(first);
        }
        if !self.jobs.contains_key(&key) {
            return Err(Status::not_found(format!("id: no job {id:?}")));
        }
        self.cancel_one(key, now, fx);
        self.process_events(now, fx);
        self.get_job(id)
    }

    fn cancel_one(&mut self, key: (u64, u32), now: i64, fx: &mut Effects) {
        let Some(e) = self.jobs.get(&key) else { return };
        match now_state(&e.job) {
            JobState::Pending | JobState::Unspecified => {
                if let Some(e) = self.jobs.get_mut(&key) {
                    e.job.reason = "cancelled by user while pending".into();
                }
                self.finish(key, JobState::Cancelled, now, fx);
            }
            JobState::Assigned | JobState::Running => {
                let node = e.job.node.clone();
                let connected = self
                    .nodes
                    .get(&node)
                    .is_some_and(|n| n.connected && !n.down);
                if connected {
                    self.cancelling.insert(key);
                    if let Some(e) = self.jobs.get_mut(&key) {
                        e.job.cancel_requested = true;
                    }
                    self.persist(key, fx);
                    let Some(e) = self.jobs.get(&key) else { return };
                    cancel_on(node, e.job.id.clone(), e.job.attempt, fx);
                } else {
                    if let Some(e) = self.jobs.get_mut(&key) {
                        e.job.reason = format!("cancelled by user; node {node} unreachable");
                    }
                    self.finish(key, JobState::Cancelled, now, fx);
                }
            }
            _ => {}
        }
    }

    /// Cordon, drain or uncordon a node.
    pub fn set_node_admin(
        &mut self,
        name: &str,
        admin: NodeAdmin,
        now: i64,
        fx: &mut Effects,
    ) -> Result<proto::v1::Node, Status> {
        self.ensure_engine(now, fx);
        let n = self
            .nodes
            .get_mut(name)
            .ok_or_else(|| Status::not_found(format!("name: no node {name:?}")))?;
        n.admin = admin;
        fx.writes.push(Write::PutNodeAdmin(name.to_string(), admin));
        self.refresh_capacity(name, now, fx);
        self.node(name).map(NodeInfo::to_proto)
    }
}

/// Why the engine put a job where it did, from the schedstats it moved.
fn placement_reason(
    before: &sched::Schedstats,
    after: &sched::Schedstats,
    has_waker: bool,
) -> String {
    let mut parts = Vec::new();
    if after.pack_placed > before.pack_placed {
        parts.push("pack: lowest-numbered node with room");
    }
    if after.wake_wide > before.wake_wide {
        parts.push("wake_wide: the waker fans out, spread");
    } else if has_waker && after.wake_affine > before.wake_affine {
        parts.push("wake_affine: near the waker");
    }
    if after.busy_skip > before.busy_skip {
        parts.push("busy-skip: cluster full, no scan");
    }
    if after.sis_easy > before.sis_easy {
        parts.push("select_idle_sibling: target had room");
    } else if after.sis_core > before.sis_core {
        parts.push("select_idle_sibling: idle host group in the rack");
    } else if after.sis_cpu > before.sis_cpu {
        parts.push("select_idle_sibling: idle node in the rack");
    } else if after.find_idlest > before.find_idlest {
        parts.push("find_idlest: emptiest zone, rack and node");
    }
    if parts.is_empty() {
        parts.push("placed");
    }
    parts.join("; ")
}

#[cfg(test)]
#[path = "cluster_tests.rs"]
mod tests;

/// Tells `node` to cancel attempt `attempt` of job `job_id` (a no-op
/// there when that attempt no longer runs).
fn cancel_on(node: String, job_id: String, attempt: u32, fx: &mut Effects) {
    fx.to_agents.push((
        node,
        DispatcherMessage {
            msg: Some(dispatcher_message::Msg::Cancel(Cancel { job_id, attempt })),
        },
    ));
}
