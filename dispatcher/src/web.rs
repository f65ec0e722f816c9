//! The dispatcher's own web page and its JSON API, served by the dispatcher
//! (no external service): `dispatcher --http-listen ADDR` serves
//!
//! | path | what |
//! |---|---|
//! | `/` | the page (one self-contained HTML file, `web/page.html`) |
//! | `/api/v1/cluster` | the aggregate: zones -> racks, queue depth by class, recent placements and steals, the jobs waiting longest and why |
//! | `/api/v1/racks/{zone}/{rack}` | one rack's nodes, with free CPUs per LLC |
//! | `/metrics` | Prometheus ([`crate::metrics`]) |
//!
//! Only the leader has a cluster to show. On a follower replica (or one
//! just elected and still loading) both API paths answer 503 with
//! [`RoleView`], e.g. `{"role":"follower","leader":"http://d1:9100",
//! "leader_grpc":"http://d1:50051"}` (`leader` is the leader's web page,
//! from its `--advertise-http-url`), and the page shows a banner linking
//! to the leader's page. A replica that steps down clears its snapshot
//! ([`Web::clear`]) so nothing stale is served if it is asked again.
//!
//! On its tick (at most every [`PUBLISH_EVERY_MS`]) the core only copies
//! what the page needs out of the cluster into a flat [`Capture`] (plain
//! numbers, names end to end in one buffer, each node's immutable CPU tree
//! shared by `Arc`: no allocation per node) and hands it to the web's
//! builder thread, which assembles the [`Snapshot`] (grouping, views,
//! strings) off the core and swaps it in behind a short lock; handlers
//! clone the `Arc` and serialise outside it, so a request never waits on
//! the core and the core never waits on a request or on the assembly. The top-level view is
//! per rack, never per node, so its size grows with racks, not nodes: at
//! 10,000 nodes the page fetches the aggregate and one rack at a time.
//!
//! Numbers are the dispatcher's own model (what it places on):
//! - busy CPUs: CPUs its jobs hold in the dispatcher's model of each node;
//! - free CPUs: idle CPUs of nodes that take new jobs (ready, connected);
//! - overloaded node: the node-level engine has jobs queued on it beyond its
//!   capacity (its overload bit, seed 000), or its agent reports
//!   overloaded CPUs (more runnable jobs than CPUs when oversubscribed);
//! - down: marked down after missed heartbeats, or its agent disconnected.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::http::header::{CACHE_CONTROL, CONTENT_TYPE};
use axum::response::{IntoResponse, Response};
use prometheus::Registry;
use proto::v1::JobState;
use serde::Serialize;

use crate::cluster::{Cluster, Move};
use crate::gate::{Gate, Role};
use crate::metrics::{Metrics, node_state};
use crate::observe::Observer;
use crate::offcore::{Handoff, Names, Span};

/// The page, embedded in the binary.
pub const PAGE: &str = include_str!("web/page.html");

/// The core rebuilds the snapshot at most this often (the page refreshes
/// every 2 s).
pub const PUBLISH_EVERY_MS: i64 = 1000;

/// Counts of one domain (a rack, a zone, the cluster).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Totals {
    /// Nodes.
    pub nodes: u32,
    /// Nodes down or disconnected.
    pub down: u32,
    /// Nodes draining or cordoned (and not down).
    pub cordoned: u32,
    /// CPUs of all nodes.
    pub cpus: u64,
    /// CPUs held by jobs (the dispatcher's model).
    pub busy_cpus: u64,
    /// Idle CPUs of nodes that take new jobs.
    pub free_cpus: u64,
    /// Nodes overloaded (see the module doc).
    pub overloaded_nodes: u32,
    /// Jobs waiting in the node-level engine's queues of these nodes.
    pub queued_jobs: u64,
    /// Jobs running, as the agents last reported.
    pub running_jobs: u64,
    /// GPUs of all nodes.
    pub gpus: u64,
    /// GPUs no job holds, of nodes that take new jobs.
    pub free_gpus: u64,
    /// Gang members holding these nodes (one per node and gang).
    pub gang_members: u64,
}

impl Totals {
    fn add(&mut self, o: &Totals) {
        self.nodes += o.nodes;
        self.down += o.down;
        self.cordoned += o.cordoned;
        self.cpus += o.cpus;
        self.busy_cpus += o.busy_cpus;
        self.free_cpus += o.free_cpus;
        self.overloaded_nodes += o.overloaded_nodes;
        self.queued_jobs += o.queued_jobs;
        self.running_jobs += o.running_jobs;
        self.gpus += o.gpus;
        self.free_gpus += o.free_gpus;
        self.gang_members += o.gang_members;
    }
}

/// One rack in the aggregate.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RackView {
    /// Rack name.
    pub name: String,
    /// Its counts.
    pub totals: Totals,
    /// The most idle CPUs in one LLC of one node taking new jobs: the
    /// largest LLC-aligned job the rack can start now.
    pub max_free_llc: u32,
    /// Gangs with a member in the rack (each counted once).
    pub gangs: u32,
}

/// One zone in the aggregate.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ZoneView {
    /// Zone name.
    pub name: String,
    /// The sum of its racks.
    pub totals: Totals,
    /// Its racks, by name.
    pub racks: Vec<RackView>,
}

/// Jobs of one latency class by state (queue depth and what runs).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ClassQueue {
    /// `latency` (latency_nice < 0) or `normal`.
    pub class: &'static str,
    /// PENDING: waiting for room (queued on a node or matching none yet).
    pub pending: i64,
    /// ASSIGNED: sent to a node, not started yet.
    pub assigned: i64,
    /// RUNNING.
    pub running: i64,
}

/// A placement or steal, for the page.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct MoveView {
    /// When (Unix ms).
    pub at_ms: i64,
    /// Job id.
    pub job: String,
    /// From node ("" for a placement).
    pub from: String,
    /// To node.
    pub to: String,
    /// Reason (placement) or level (steal).
    pub why: String,
}

impl From<&Move> for MoveView {
    fn from(m: &Move) -> Self {
        Self {
            at_ms: m.at_ms,
            job: m.job.to_string(),
            from: m.from.to_string(),
            to: m.to.to_string(),
            why: m.why(),
        }
    }
}

/// A PENDING job among those waiting longest, and why it waits (the
/// API's `PendingReason`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct WaitingView {
    /// Job id.
    pub job: String,
    /// Since it was submitted, ms.
    pub waiting_ms: i64,
    /// The kind's name (`queued_behind`, `no_match_cpus`, ...).
    pub kind: String,
    /// The node it waits on ("" for none).
    pub node: String,
    /// Jobs ahead of it in that node's queue.
    pub jobs_ahead: u32,
    /// When the wait ends at the latest (Unix ms; 0 unknown).
    pub until_ms: i64,
    /// The sentence with the numbers.
    pub message: String,
}

/// How many of the longest-waiting jobs the aggregate shows.
pub const WAITING_SHOWN: usize = 20;

/// `/api/v1/cluster`: bounded by the number of racks, not nodes.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ClusterView {
    /// When the core built it (Unix ms; 0 before the first tick).
    pub generated_ms: i64,
    /// The whole cluster.
    pub totals: Totals,
    /// Zones by name, each with its racks.
    pub zones: Vec<ZoneView>,
    /// Jobs by latency class.
    pub queue: Vec<ClassQueue>,
    /// Steals the node-level engine made since it was (re)built.
    pub engine_steals: u64,
    /// The last placements, newest first.
    pub recent_placements: Vec<MoveView>,
    /// The last steals, newest first.
    pub recent_steals: Vec<MoveView>,
    /// The [`WAITING_SHOWN`] PENDING jobs waiting longest, oldest first,
    /// with why they wait.
    pub waiting: Vec<WaitingView>,
}

/// One node in a rack's detail.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct NodeView {
    /// Node name.
    pub name: String,
    /// ready / down / disconnected / draining / cordoned.
    pub state: &'static str,
    /// Host group ("" when unlabelled).
    pub hostgroup: String,
    /// CPUs.
    pub cpus: u32,
    /// CPUs held by jobs (the dispatcher's model).
    pub busy_cpus: u32,
    /// Per LLC (in the node's order): its CPUs.
    pub llc_cpus: Vec<u32>,
    /// Per LLC: idle CPUs (the dispatcher's model).
    pub llc_free: Vec<u32>,
    /// Overloaded (see the module doc).
    pub overloaded: bool,
    /// CPUs the agent reports overloaded.
    pub overloaded_cpus: u32,
    /// Jobs queued on it in the node-level engine.
    pub queued_jobs: u64,
    /// Jobs running, as its agent reported.
    pub running_jobs: u32,
    /// Jobs started but time-sliced out, as its agent reported.
    pub waiting_jobs: u32,
    /// CPUs its agent reported busy.
    pub reported_busy_cpus: u32,
    /// Time since its last report, ms.
    pub heartbeat_age_ms: i64,
    /// GPUs.
    pub gpus: u32,
    /// GPUs no job holds (queued, assigned or running there).
    pub gpus_free: u32,
    /// The gangs with a member holding it (`j-N`), ascending.
    pub gangs: Vec<String>,
}

/// `/api/v1/racks/{zone}/{rack}`: one rack's nodes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RackDetail {
    /// When the core built it (Unix ms).
    pub generated_ms: i64,
    /// Zone.
    pub zone: String,
    /// Rack.
    pub rack: String,
    /// Its counts (as in the aggregate).
    pub totals: Totals,
    /// Its nodes by name.
    pub nodes: Vec<NodeView>,
}

/// What a replica that does not lead answers on the API paths (503).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RoleView {
    /// `follower`, or `starting` (elected, loading its state).
    pub role: &'static str,
    /// The leader's web page URL when known (its `--advertise-http-url`).
    pub leader: Option<String>,
    /// The leader's gRPC advertise URL when known (for dispatchctl).
    pub leader_grpc: Option<String>,
    /// A sentence for people and for the page's error path.
    pub error: String,
}

impl RoleView {
    /// The answer for `role`; None when it leads.
    pub fn of(role: &Role) -> Option<Self> {
        match role {
            Role::Leader(_) => None,
            Role::Starting => Some(Self {
                role: "starting",
                leader: None,
                leader_grpc: None,
                error: "this replica was just elected leader and is loading its state; retry"
                    .to_string(),
            }),
            Role::Follower {
                leader,
                leader_http,
            } => {
                let error = match (leader_http, leader) {
                    (Some(page), _) => {
                        format!("this replica is a follower; the leader is at {page}")
                    }
                    (None, Some(grpc)) => format!(
                        "this replica is a follower; the leader is at {grpc} \
                         (it publishes no web page URL: start it with --advertise-http-url)"
                    ),
                    (None, None) => {
                        "this replica is a follower; the leader is not known yet".to_string()
                    }
                };
                Some(Self {
                    role: "follower",
                    leader: leader_http.clone(),
                    leader_grpc: leader.clone(),
                    error,
                })
            }
        }
    }
}

/// What the core publishes on its tick.
#[derive(Debug, Default)]
pub struct Snapshot {
    /// The aggregate.
    pub cluster: ClusterView,
    /// Every rack's detail, by (zone, rack).
    pub racks: BTreeMap<(String, String), RackDetail>,
}

/// One node as the core copies it for the snapshot: numbers, ranges into
/// the capture's shared buffers, and the node's CPU tree shared by `Arc`
/// (immutable once built). No allocation per node.
#[derive(Debug)]
struct NodeCopy {
    name: Span,
    zone: Span,
    rack: Span,
    hostgroup: Span,
    /// Its `cpu_busy` in [`Capture::busy`].
    busy: (u32, u32),
    cpu_topo: Arc<sched::Topology>,
    state: &'static str,
    queued: u64,
    engine_overloaded: bool,
    overloaded_cpus: u32,
    running_jobs: u32,
    waiting_jobs: u32,
    reported_busy_cpus: u32,
    last_heartbeat_ms: i64,
    gpus: u32,
    gpus_free: u32,
    /// The gangs holding it, in [`Capture::gangs`].
    gangs: (u32, u32),
}

/// What the core copies out of the cluster on its tick: the flat,
/// per-node part ([`NodeCopy`]) and the bounded lists. The snapshot is
/// assembled from it off the core ([`assemble`]).
#[derive(Debug, Default)]
pub struct Capture {
    now_ms: i64,
    /// Every node's name, zone, rack and host group, end to end.
    text: Names,
    /// Every node's CPU model, end to end.
    busy: Vec<bool>,
    /// Every node's gangs (job numbers), end to end.
    gangs: Vec<u64>,
    nodes: Vec<NodeCopy>,
    job_counts: Vec<(JobState, &'static str, i64)>,
    engine_steals: u64,
    recent_placements: Vec<MoveView>,
    recent_steals: Vec<MoveView>,
    waiting: Vec<WaitingView>,
}

impl Capture {
    /// Nodes copied.
    pub fn nodes(&self) -> usize {
        self.nodes.len()
    }
}

/// Copy what the snapshot needs out of the cluster: O(nodes x CPUs per
/// node) copies of plain numbers, on the core. `job_counts` are jobs by
/// (state, class) (see [`Metrics::job_counts`]).
pub fn capture(
    cluster: &Cluster,
    job_counts: Vec<(JobState, &'static str, i64)>,
    now_ms: i64,
) -> Capture {
    let nr = cluster.nodes().size_hint().0;
    let mut c = Capture {
        now_ms,
        nodes: Vec::with_capacity(nr),
        text: Names::with_capacity(nr * 32),
        busy: Vec::with_capacity(nr * 16),
        job_counts,
        ..Capture::default()
    };
    // (No gangs: no lookup per node.)
    let any_gangs = !cluster.gangs().is_empty();
    for n in cluster.nodes() {
        let (queued, engine_overloaded) = match (cluster.engine(), cluster.engine_leaf(&n.name)) {
            (Some(engine), Some(leaf)) if leaf < engine.topology().nr_leaves() => {
                let rq = engine.rq(leaf);
                (rq.nr_waiting() as u64, rq.is_overloaded())
            }
            _ => (0, false),
        };
        let start = c.busy.len() as u32;
        c.busy.extend(n.busy_flags());
        let gangs_start = c.gangs.len() as u32;
        if any_gangs {
            c.gangs.extend(cluster.gangs_on(&n.name));
        }
        let node = NodeCopy {
            name: c.text.push(&[&n.name]),
            zone: c.text.push(&[n.zone()]),
            rack: c.text.push(&[n.rack()]),
            hostgroup: c.text.push(&[n.hostgroup()]),
            busy: (start, c.busy.len() as u32),
            cpu_topo: n.cpu_topo().clone(),
            state: node_state(n),
            queued,
            engine_overloaded,
            overloaded_cpus: n.load.overloaded_cpus(),
            running_jobs: n.load.running_jobs(),
            waiting_jobs: n.load.waiting_jobs(),
            reported_busy_cpus: n.load.busy_cpus(),
            last_heartbeat_ms: n.last_heartbeat_ms,
            gpus: n.gpus,
            // (No GPUs: none free, without the two lookups.)
            gpus_free: if n.gpus == 0 {
                0
            } else {
                cluster.gpus_free(&n.name)
            },
            gangs: (gangs_start, c.gangs.len() as u32),
        };
        c.nodes.push(node);
    }
    c.engine_steals = cluster.steals();
    c.recent_placements = cluster.recent_placements().rev().map(Into::into).collect();
    c.recent_steals = cluster.recent_steals().rev().map(Into::into).collect();
    c.waiting = cluster
        .longest_waiting(WAITING_SHOWN, now_ms)
        .into_iter()
        .map(|(job, r)| WaitingView {
            job: job.id(),
            waiting_ms: (now_ms - job.submit_time_ms).max(0),
            kind: proto::pending::kind_name(r.kind),
            node: r.node,
            jobs_ahead: r.jobs_ahead,
            until_ms: r.until_ms,
            message: r.message,
        })
        .collect();
    c
}

/// One node's view and its contribution to its rack's totals, with the
/// gangs (job numbers) holding it.
fn node_view<'c>(c: &'c Capture, n: &NodeCopy) -> (NodeView, Totals, u32, &'c [u64]) {
    let cpu_busy = &c.busy[n.busy.0 as usize..n.busy.1 as usize];
    let gangs = &c.gangs[n.gangs.0 as usize..n.gangs.1 as usize];
    let llcs = n.cpu_topo.llcs().len();
    let (mut llc_cpus, mut llc_free) = (Vec::with_capacity(llcs), Vec::with_capacity(llcs));
    for llc in n.cpu_topo.llcs() {
        llc_cpus.push(llc.members.len() as u32);
        let free = llc
            .members
            .iter()
            .filter(|&&l| !cpu_busy.get(l).copied().unwrap_or(false))
            .count();
        llc_free.push(free as u32);
    }
    let busy = cpu_busy.iter().filter(|&&b| b).count() as u32;
    let cpus = cpu_busy.len() as u32;
    let overloaded = n.engine_overloaded || n.overloaded_cpus > 0;
    let state = n.state;
    let takes_jobs = state == "ready";
    let max_free_llc = if takes_jobs {
        llc_free.iter().copied().max().unwrap_or(0)
    } else {
        0
    };
    let view = NodeView {
        name: c.text.get(n.name).to_string(),
        state,
        hostgroup: c.text.get(n.hostgroup).to_string(),
        cpus,
        busy_cpus: busy,
        llc_cpus,
        overloaded,
        overloaded_cpus: n.overloaded_cpus,
        queued_jobs: n.queued,
        running_jobs: n.running_jobs,
        waiting_jobs: n.waiting_jobs,
        reported_busy_cpus: n.reported_busy_cpus,
        heartbeat_age_ms: (c.now_ms - n.last_heartbeat_ms).max(0),
        llc_free,
        gpus: n.gpus,
        gpus_free: n.gpus_free,
        gangs: gangs.iter().map(|g| format!("j-{g}")).collect(),
    };
    let totals = Totals {
        nodes: 1,
        down: u32::from(matches!(state, "down" | "disconnected")),
        cordoned: u32::from(matches!(state, "draining" | "cordoned")),
        cpus: u64::from(cpus),
        busy_cpus: u64::from(busy),
        free_cpus: if takes_jobs {
            u64::from(cpus - busy)
        } else {
            0
        },
        overloaded_nodes: u32::from(overloaded),
        queued_jobs: n.queued,
        running_jobs: u64::from(n.running_jobs),
        gpus: u64::from(n.gpus),
        free_gpus: if takes_jobs {
            u64::from(n.gpus_free)
        } else {
            0
        },
        gang_members: gangs.len() as u64,
    };
    (view, totals, max_free_llc, gangs)
}

/// Build the snapshot from a capture: the grouping, the views and their
/// strings. Runs off the core (the web's builder thread).
pub fn assemble(c: Capture) -> Snapshot {
    let now_ms = c.now_ms;
    // Keyed by borrowed names while nodes are visited: no allocation per
    // node for the key.
    let mut racks: BTreeMap<(&str, &str), (RackDetail, u32, BTreeSet<u64>)> = BTreeMap::new();
    for n in &c.nodes {
        let (view, totals, max_free_llc, gangs) = node_view(&c, n);
        let (zone, rack) = (c.text.get(n.zone), c.text.get(n.rack));
        let (detail, best, rack_gangs) = racks.entry((zone, rack)).or_insert_with(|| {
            (
                RackDetail {
                    generated_ms: now_ms,
                    zone: zone.to_string(),
                    rack: rack.to_string(),
                    totals: Totals::default(),
                    nodes: Vec::new(),
                },
                0,
                BTreeSet::new(),
            )
        });
        rack_gangs.extend(gangs.iter().copied());
        detail.totals.add(&totals);
        detail.nodes.push(view);
        *best = (*best).max(max_free_llc);
    }
    let mut view = ClusterView {
        generated_ms: now_ms,
        ..ClusterView::default()
    };
    for (&(zone, rack), (detail, max_free_llc, gangs)) in &racks {
        if view.zones.last().is_none_or(|z| z.name != zone) {
            view.zones.push(ZoneView {
                name: zone.to_string(),
                totals: Totals::default(),
                racks: Vec::new(),
            });
        }
        if let Some(z) = view.zones.last_mut() {
            z.totals.add(&detail.totals);
            z.racks.push(RackView {
                name: rack.to_string(),
                totals: detail.totals.clone(),
                max_free_llc: *max_free_llc,
                gangs: gangs.len() as u32,
            });
        }
        view.totals.add(&detail.totals);
    }
    for class in ["latency", "normal"] {
        let count = |state: JobState| {
            c.job_counts
                .iter()
                .filter(|(s, cl, _)| *s == state && *cl == class)
                .map(|(_, _, n)| *n)
                .sum()
        };
        view.queue.push(ClassQueue {
            class,
            pending: count(JobState::Pending),
            assigned: count(JobState::Assigned),
            running: count(JobState::Running),
        });
    }
    view.engine_steals = c.engine_steals;
    // A rack's node list is held until the next publish: without the
    // spare room its pushes left (up to as much again).
    let racks = racks
        .into_iter()
        .map(|((zone, rack), (mut d, _, _))| {
            d.nodes.shrink_to_fit();
            ((zone.to_string(), rack.to_string()), d)
        })
        .collect();
    view.recent_placements = c.recent_placements;
    view.recent_steals = c.recent_steals;
    view.waiting = c.waiting;
    Snapshot {
        cluster: view,
        racks,
    }
}

/// Build the snapshot in one go (tests and benchmarks): [`capture`] then
/// [`assemble`].
pub fn build(
    cluster: &Cluster,
    job_counts: &[(JobState, &'static str, i64)],
    now_ms: i64,
) -> Snapshot {
    assemble(capture(cluster, job_counts.to_vec(), now_ms))
}

/// The published snapshot and its term, shared with the builder thread.
#[derive(Default)]
struct Published {
    current: Mutex<Arc<Snapshot>>,
    /// Bumped by [`Web::clear`] under `current`'s lock: a capture of an
    /// earlier term is dropped.
    term: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Published {
    /// The builder thread's work: assemble a capture off the core and
    /// publish it unless the replica stepped down since it was taken.
    fn assemble_and_publish(&self, term: u64, capture: Capture) {
        let snap = Arc::new(assemble(capture));
        // The term is read under the lock `clear` bumps it under: a
        // snapshot of the previous term never replaces the cleared one.
        let mut current = lock(&self.current);
        if self.term.load(Ordering::Acquire) == term {
            *current = snap;
        }
    }
}

/// The published snapshot and what the handlers need.
pub struct Web {
    published: Arc<Published>,
    /// Captures on their way to the `dispatch-web` builder thread.
    builder: Handoff<(u64, Capture)>,
    last_built_ms: AtomicI64,
    metrics: Arc<Metrics>,
    /// This replica's role (unset: a single dispatcher, always leading).
    gate: OnceLock<Gate>,
}

impl Web {
    /// An empty snapshot until the core's first tick; job counts come from
    /// `metrics` (which the core samples on the same tick).
    pub fn new(metrics: Arc<Metrics>) -> Self {
        let published = Arc::new(Published::default());
        let shared = published.clone();
        Self {
            published,
            builder: Handoff::new("dispatch-web", move |(term, capture)| {
                shared.assemble_and_publish(term, capture)
            }),
            last_built_ms: AtomicI64::new(i64::MIN),
            metrics,
            gate: OnceLock::new(),
        }
    }

    /// Answer according to this replica's role from now on (once; the
    /// gate of an etcd replica).
    pub fn follow_role(&self, gate: Gate) {
        let _ = self.gate.set(gate);
    }

    /// What to answer instead of the snapshot when this replica does not
    /// lead.
    pub fn not_leading(&self) -> Option<RoleView> {
        let gate = self.gate.get()?;
        RoleView::of(&gate.watch().borrow())
    }

    /// Forget the published snapshot (the replica stepped down; its core
    /// has stopped): the next term starts from an empty one, and a capture
    /// of this term still being assembled is dropped.
    pub fn clear(&self) {
        let mut current = lock(&self.published.current);
        self.published.term.fetch_add(1, Ordering::AcqRel);
        *current = Arc::new(Snapshot::default());
        drop(current);
        self.last_built_ms.store(i64::MIN, Ordering::Relaxed);
    }

    /// The core's tick: if [`PUBLISH_EVERY_MS`] has passed since the last
    /// build (or the clock went back), copy the cluster ([`capture`]) and
    /// hand the copy to the builder thread, which assembles and publishes
    /// it ([`assemble`]) off the core.
    pub fn publish(&self, cluster: &Cluster, now_ms: i64) {
        let last = self.last_built_ms.load(Ordering::Relaxed);
        if last != i64::MIN && now_ms >= last && now_ms - last < PUBLISH_EVERY_MS {
            return;
        }
        self.last_built_ms.store(now_ms, Ordering::Relaxed);
        let term = self.published.term.load(Ordering::Acquire);
        let copy = capture(cluster, self.metrics.job_counts(), now_ms);
        self.builder.hand((term, copy));
    }

    /// Wait until every capture handed over so far is assembled (tests).
    pub fn wait_built(&self) {
        self.builder.wait_done();
    }

    /// The last published snapshot.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        lock(&self.published.current).clone()
    }
}

impl Observer for Web {
    fn leading(&self, leading: bool) {
        if !leading {
            self.clear();
        }
    }

    fn tick(&self, cluster: &Cluster, now_ms: i64) {
        self.publish(cluster, now_ms);
    }
}

#[derive(Clone)]
struct AppState {
    web: Arc<Web>,
}

fn json<T: Serialize>(status: StatusCode, value: &T) -> Response {
    match serde_json::to_vec(value) {
        Ok(body) => (
            status,
            [
                (CONTENT_TYPE, "application/json"),
                (CACHE_CONTROL, "no-store"),
            ],
            body,
        )
            .into_response(),
        Err(err) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("cannot encode the response: {err}"),
        )
            .into_response(),
    }
}

async fn page() -> Response {
    (
        [
            (CONTENT_TYPE, "text/html; charset=utf-8"),
            (CACHE_CONTROL, "no-store"),
        ],
        PAGE,
    )
        .into_response()
}

async fn cluster_view(State(s): State<AppState>) -> Response {
    if let Some(role) = s.web.not_leading() {
        return json(StatusCode::SERVICE_UNAVAILABLE, &role);
    }
    let snap = s.web.snapshot();
    json(StatusCode::OK, &snap.cluster)
}

async fn rack_detail(
    State(s): State<AppState>,
    Path((zone, rack)): Path<(String, String)>,
) -> Response {
    if let Some(role) = s.web.not_leading() {
        return json(StatusCode::SERVICE_UNAVAILABLE, &role);
    }
    let snap = s.web.snapshot();
    let key = (zone, rack);
    match snap.racks.get(&key) {
        Some(detail) => json(StatusCode::OK, detail),
        None => json(
            StatusCode::NOT_FOUND,
            &serde_json::json!({
                "error": format!("no rack {:?} in zone {:?}", key.1, key.0),
            }),
        ),
    }
}

/// The routes: the page, the API and `/metrics`.
pub fn router(web: Arc<Web>, registry: Registry) -> axum::Router {
    axum::Router::new()
        .route("/", axum::routing::get(page))
        .route("/api/v1/cluster", axum::routing::get(cluster_view))
        .route(
            "/api/v1/racks/{zone}/{rack}",
            axum::routing::get(rack_detail),
        )
        .with_state(AppState { web })
        .merge(dispatch_telemetry::prom::router(registry))
}

/// Bind `addr` and serve [`router`] on it in a background task; returns
/// the bound address.
pub async fn spawn_server(
    addr: SocketAddr,
    web: Arc<Web>,
    registry: Registry,
) -> std::io::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let app = router(web, registry);
    tokio::spawn(async move {
        if let Err(err) = axum::serve(listener, app).await {
            tracing::error!(%err, "the web endpoint stopped");
        }
    });
    Ok(bound)
}

#[cfg(test)]
#[path = "web_tests.rs"]
mod tests;
