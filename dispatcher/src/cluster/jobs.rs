//! The job table: every job's [`Phase`] (the one field that says where a
//! job is and why), its engine task, its modelled CPUs, and the indexes
//! that let every operation reach the jobs it needs without scanning the
//! table.
//!
//! Invariants (checked by [`Jobs::check`], which the model-based test runs
//! after every step):
//! - a job's proto record (`state`, `node`, `reason`) is derived from its
//!   phase: it is written only by [`Jobs::set_phase`];
//! - the indexes hold exactly the keys of the jobs in the phases they
//!   name: `by_node[n]` the jobs that hold node `n` (Assigned, Running,
//!   AwaitingNode; listed by the registry slot the phase's name carries,
//!   else by the name: `ByNode`), `awaiting`, `unplaced`, `queued`, and `unasked` the
//!   Assigned ones not asked back yet, by (`since`, key), so that the tick
//!   finds the jobs due for an agent-level steal without visiting every
//!   ASSIGNED job (no index of all ASSIGNED jobs: nothing reads one, and
//!   keeping it cost two B-tree updates per job); `gpus_by_node[n]` the GPUs asked by the
//!   jobs whose phase names node `n` (Queued there, Assigned, Running,
//!   AwaitingNode): the GPUs the dispatcher counts as taken on it;
//! - `reason` is display text, generated from the phase, the requeue
//!   history and the placement data; nothing reads it back.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::fmt;
use std::sync::Arc;

use proto::v1::JobState;

pub use crate::record::{JobKey, JobRecord, NodeName, Text};
use sched::idhash::IdMap;

use super::nodes::NodeSlot;
use super::slab::Slab;
use sched::{Align, LeafId, PlacePath, Placement, TaskId, WakeChoice};

/// Why a PENDING job is not in the engine.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Unplaced {
    /// Just accepted, not placed yet.
    New,
    /// No node has registered.
    NoNodes,
    /// No registered node matches the spec.
    NoMatch {
        /// The spec's node selector (shared by the jobs that wait for
        /// the same one: [`Jobs::set_phase`] interns it).
        selector: Arc<BTreeMap<String, String>>,
        /// CPUs asked.
        cpus: u32,
        /// Their alignment.
        align: Align,
        /// Memory asked (0 = none).
        memory_bytes: u64,
        /// GPUs asked (0 = none).
        gpus: u32,
    },
    /// Nodes have the GPUs asked, but none has that many free now: placed
    /// again when a job's GPUs are freed.
    GpusBusy {
        /// GPUs asked.
        gpus: u32,
    },
    /// The engine refused the task.
    EngineRefused(String),
    /// Back to PENDING (see the job's last [`Requeue`]), about to be
    /// placed again.
    Requeued,
    /// Restored PENDING after a dispatcher restart, not placed since (its
    /// reason is the one the store holds).
    Restored,
    /// A gang member: its gang waits for nodes (`cluster::gang`).
    Gang,
    /// Every node it may use is reserved for a waiting gang, and it would
    /// not end before the reservation's start (no timeout, or too long).
    Reserved {
        /// The gang holding the reservation.
        gang: JobKey,
        /// The reservation's start (ms).
        until_ms: i64,
    },
}

/// How far a steal moved a job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StealLevel {
    /// To a node of the same rack.
    SameRack,
    /// To another rack of the same zone.
    SameZone,
    /// To another zone.
    OtherZone,
}

impl StealLevel {
    /// As shown to users.
    pub fn name(self) -> &'static str {
        match self {
            StealLevel::SameRack => "same rack",
            StealLevel::SameZone => "same zone",
            StealLevel::OtherZone => "another zone",
        }
    }
}

/// How a job came to its node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Via {
    /// The engine placed it and it started at once.
    Placed(Placement),
    /// The engine queued it on this node (no node had room) and started
    /// it there later.
    Waited(Placement),
    /// An idle node stole it from an overloaded one's queue.
    Stolen {
        /// The node it was queued on.
        from: NodeName,
        /// How far it moved.
        level: StealLevel,
    },
    /// It was on its node before a dispatcher restart (its reason is the
    /// one the store holds).
    Restored,
}

/// How a job ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum End {
    /// Its agent reported it (with a message, or none).
    Reported(String),
    /// Cancelled while PENDING.
    CancelledPending,
    /// Cancelled while its node was unreachable.
    CancelledUnreachable(String),
    /// Cancelled; its node re-registered without it.
    CancelledGone(String),
    /// Cancelled; its node gave it back unstarted.
    CancelledGivenBack(String),
    /// Cancelled; its node was lost.
    CancelledLost,
    /// Cancelled because another member of its gang ended without
    /// succeeding.
    GangEnded {
        /// The member that ended first.
        member: JobKey,
        /// How it ended.
        state: JobState,
    },
    /// A stale attempt, retried after its node was lost, ended there
    /// (SUCCEEDED or FAILED), reported when the node came back while the
    /// retry waited unsent: the job took that result and the retry was
    /// withdrawn.
    StaleAttemptEnded {
        /// The attempt that ran.
        attempt: u32,
        /// Its node.
        node: String,
        /// How it ended.
        state: JobState,
    },
    /// Lost with its node, no retries left.
    Lost {
        /// The node.
        node: String,
        /// Why the node counts as lost.
        why: &'static str,
    },
}

/// Why a job went back to PENDING (its history, newest last).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Requeue {
    /// Its node was lost; this is retry `n` of `of`.
    Retry {
        /// Retry number (1 = first).
        n: u32,
        /// The job's retry budget.
        of: u32,
        /// The lost node.
        node: String,
        /// Why it counts as lost.
        why: &'static str,
    },
    /// Its node gave it back unstarted (an agent-level steal).
    GivenBack(String),
    /// Its gang restarted: a member could not be replaced inside the
    /// gang's domain.
    GangRestart,
}

/// Where a job is in its lifecycle, and why. The job's user-visible
/// state, node and reason are derived from it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Phase {
    /// PENDING and not in the engine: no node can take it now.
    Unplaced {
        /// Why.
        why: Unplaced,
    },
    /// PENDING, a task of the engine on `node`: about to be sent there
    /// (`waiting == false`) or waiting in its queue (stealable).
    Queued {
        /// The node.
        node: NodeName,
        /// How it got there.
        via: Via,
        /// Waiting in the node's queue (no node had room).
        waiting: bool,
    },
    /// ASSIGNED: sent to `node`'s agent, not reported started.
    Assigned {
        /// The node.
        node: NodeName,
        /// When it was sent (ms).
        since: i64,
        /// When the agent was asked to give it back (`Steal`), if it was.
        steal_asked: Option<i64>,
        /// How it got there.
        via: Via,
    },
    /// RUNNING on `node`.
    Running {
        /// The node.
        node: NodeName,
        /// How it got there.
        via: Via,
    },
    /// ASSIGNED or RUNNING before a dispatcher restart; `node` has not
    /// reported it since. Lost at `deadline` (ms).
    AwaitingNode {
        /// The node.
        node: NodeName,
        /// When it counts as lost.
        deadline: i64,
        /// It was RUNNING (else ASSIGNED).
        running: bool,
    },
    /// Terminal.
    Done {
        /// SUCCEEDED, FAILED, CANCELLED or LOST.
        state: JobState,
        /// How it ended.
        end: End,
    },
}

impl Phase {
    /// The state shown to users.
    pub fn state(&self) -> JobState {
        match self {
            Phase::Unplaced { .. } | Phase::Queued { .. } => JobState::Pending,
            Phase::Assigned { .. } => JobState::Assigned,
            Phase::Running { .. } => JobState::Running,
            Phase::AwaitingNode { running, .. } => {
                if *running {
                    JobState::Running
                } else {
                    JobState::Assigned
                }
            }
            Phase::Done { state, .. } => *state,
        }
    }

    /// The node the job is on or queued on.
    pub fn node(&self) -> Option<&str> {
        self.node_name().map(NodeName::as_str)
    }

    /// [`Phase::node`], its name shared.
    pub fn node_name(&self) -> Option<&NodeName> {
        match self {
            Phase::Queued { node, .. }
            | Phase::Assigned { node, .. }
            | Phase::Running { node, .. }
            | Phase::AwaitingNode { node, .. } => Some(node),
            Phase::Unplaced { .. } | Phase::Done { .. } => None,
        }
    }

    /// [`Phase::holds`], its name shared.
    fn holds_name(&self) -> Option<&NodeName> {
        match self {
            Phase::Assigned { node, .. }
            | Phase::Running { node, .. }
            | Phase::AwaitingNode { node, .. } => Some(node),
            _ => None,
        }
    }

    /// The node the job holds (its CPUs are counted there): ASSIGNED or
    /// RUNNING, restored or not.
    pub fn holds(&self) -> Option<&str> {
        match self {
            Phase::Assigned { node, .. }
            | Phase::Running { node, .. }
            | Phase::AwaitingNode { node, .. } => Some(node),
            _ => None,
        }
    }

    /// ASSIGNED or RUNNING and known to its node (a task of the engine).
    pub fn on_node(&self) -> Option<&str> {
        match self {
            Phase::Assigned { node, .. } | Phase::Running { node, .. } => Some(node),
            _ => None,
        }
    }

    /// True once the job ended.
    pub fn is_done(&self) -> bool {
        matches!(self, Phase::Done { .. })
    }
}

/// Text of a placement decision.
pub fn placement_text(how: Placement) -> String {
    let mut s = String::new();
    push_placement(&mut s, how);
    s
}

/// [`placement_text`], appended to `out` (the reasons are built in one
/// buffer: they are written at every phase change).
fn push_placement(out: &mut String, how: Placement) {
    let start = out.len();
    let part = |out: &mut String, text: &str| {
        if out.len() > start {
            out.push_str("; ");
        }
        out.push_str(text);
    };
    if how.path == PlacePath::Pack {
        part(out, "pack: lowest-numbered node with room");
    }
    match how.wake {
        WakeChoice::Wide => part(out, "wake_wide: the waker fans out, spread"),
        WakeChoice::Affine => part(out, "wake_affine: near the waker"),
        WakeChoice::None | WakeChoice::Prev => {}
    }
    match how.path {
        PlacePath::BusySkip => part(out, "busy-skip: cluster full, no scan"),
        PlacePath::IdlestBusySkip => {
            part(out, "busy-skip: cluster full, no scan");
            part(out, "find_idlest: emptiest zone, rack and node");
        }
        PlacePath::Target => part(out, "select_idle_sibling: target had room"),
        PlacePath::IdleCore => part(out, "select_idle_sibling: idle host group in the rack"),
        PlacePath::IdleLeaf => part(out, "select_idle_sibling: idle node in the rack"),
        PlacePath::Idlest => part(out, "find_idlest: emptiest zone, rack and node"),
        PlacePath::Pack | PlacePath::NoneIdle => {}
    }
    if out.len() == start {
        out.push_str("placed");
    }
}

impl Unplaced {
    /// The text of [`Unplaced::New`].
    const NEW: &'static str = "submitted";
    /// The text of [`Unplaced::NoNodes`].
    const NO_NODES: &'static str = "no nodes registered yet";
    /// The text of [`Unplaced::Requeued`] without a recorded requeue.
    const REQUEUED: &'static str = "requeued";
}

impl fmt::Display for Unplaced {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Unplaced::New => f.write_str(Self::NEW),
            Unplaced::NoNodes => f.write_str(Self::NO_NODES),
            Unplaced::NoMatch {
                selector,
                cpus,
                align,
                memory_bytes,
                gpus,
            } => {
                let mut why = Vec::new();
                if !selector.is_empty() {
                    why.push(format!("selector {selector:?}"));
                }
                why.push(format!("{cpus} CPUs aligned to {}", align.name()));
                if *memory_bytes > 0 {
                    why.push(format!("{memory_bytes} bytes of memory"));
                }
                if *gpus > 0 {
                    why.push(format!("{gpus} GPUs"));
                }
                write!(f, "no node matches {}", why.join(", "))
            }
            Unplaced::GpusBusy { gpus } => {
                write!(f, "waiting for {gpus} free GPUs on one node")
            }
            Unplaced::EngineRefused(err) => write!(f, "engine refused the job: {err}"),
            Unplaced::Requeued => f.write_str(Self::REQUEUED),
            Unplaced::Restored => write!(f, "restored after a dispatcher restart"),
            Unplaced::Gang => write!(f, "gang waiting for nodes: all members start together"),
            Unplaced::Reserved { gang, .. } => write!(
                f,
                "the nodes it may use are reserved for gang {gang}, and it would not end \
                 before the reservation's start"
            ),
        }
    }
}

impl fmt::Display for Requeue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Requeue::Retry { n, of, node, why } => {
                write!(f, "retry {n} of {of}: node {node} lost ({why})")
            }
            Requeue::GangRestart => write!(
                f,
                "gang restart: a member could not be replaced inside the gang's domain"
            ),
            Requeue::GivenBack(node) => write!(
                f,
                "steal: {node} gave it back unstarted (an idle rack peer had room)"
            ),
        }
    }
}

impl fmt::Display for End {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            End::Reported(m) => write!(f, "{m}"),
            End::CancelledPending => write!(f, "cancelled by user while pending"),
            End::CancelledUnreachable(n) => write!(f, "cancelled by user; node {n} unreachable"),
            End::CancelledGone(n) => write!(f, "cancelled by user; {n} no longer had it"),
            End::CancelledGivenBack(n) => {
                write!(f, "cancelled by user; {n} gave it back unstarted")
            }
            End::CancelledLost => write!(f, "cancelled by user; its node was lost"),
            End::StaleAttemptEnded {
                attempt,
                node,
                state,
            } => write!(
                f,
                "attempt {attempt} {} on {node}, reported when the node came back; \
                 the retry, not sent yet, was withdrawn",
                if *state == JobState::Succeeded {
                    "succeeded"
                } else {
                    "failed"
                }
            ),
            End::Lost { node, why } => write!(f, "node {node} lost ({why}), no retries left"),
            End::GangEnded { member, state } => write!(
                f,
                "gang member {member} ended {}: the rest of the gang is cancelled",
                state.as_str_name().strip_prefix("JOB_STATE_").unwrap_or("")
            ),
        }
    }
}

/// How a job came to `node`, as text (None: keep the stored text).
pub(super) fn via_text(via: &Via, node: &str, last: Option<&Requeue>) -> Option<String> {
    let mut s = String::new();
    via_text_into(&mut s, via, node, last).then_some(s)
}

/// [`via_text`] appended to `out` (false, nothing appended: keep the
/// stored text). The phase changes write into one reused buffer rather
/// than a new `String` per text.
fn via_text_into(out: &mut String, via: &Via, node: &str, last: Option<&Requeue>) -> bool {
    use fmt::Write as _;
    let history = |s: &mut String| {
        if let Some(r) = last {
            let _ = write!(s, "{r} | ");
        }
    };
    match via {
        Via::Placed(how) => {
            history(out);
            push_placement(out, *how);
            out.push_str(" -> ");
            out.push_str(node);
        }
        Via::Waited(how) => {
            out.push_str("started on ");
            out.push_str(node);
            out.push_str(" when it had room; was ");
            history(out);
            push_queued(out, *how, node);
        }
        Via::Stolen { from, level } => {
            let _ = write!(
                out,
                "steal: {node} took it from overloaded {from} ({})",
                level.name()
            );
        }
        Via::Restored => return false,
    }
    true
}

/// "queued on {node} ({placement}): no node has room", appended to `out`.
fn push_queued(out: &mut String, how: Placement, node: &str) {
    out.push_str("queued on ");
    out.push_str(node);
    out.push_str(" (");
    push_placement(out, how);
    out.push_str("): no node has room");
}

/// The display text of a gang member placed with its gang (None: not a
/// gang member on a node; the phase's own text applies).
fn gang_text(phase: &Phase, job: &JobRecord, last: Option<&Requeue>) -> Option<String> {
    if !job.is_gang() {
        return None;
    }
    let node = match phase {
        Phase::Queued {
            node,
            via: Via::Placed(_),
            ..
        }
        | Phase::Assigned {
            node,
            via: Via::Placed(_),
            ..
        }
        | Phase::Running {
            node,
            via: Via::Placed(_),
        } => node,
        _ => return None,
    };
    let text = format!(
        "gang {}: member {} of {} placed with the others -> {node}",
        job.key().array(),
        job.index(),
        job.gang_size
    );
    Some(match last {
        Some(r) => format!("{r} | {text}"),
        None => text,
    })
}

/// What the reason text of a phase is made of when it is the "how it came
/// to its node" text ([`via_text`], or [`gang_text`] for a gang member):
/// the node and the way, plus the last requeue and the job's gang fields,
/// which do not change between two phase changes without a requeue. None
/// for the other phases (their texts have other inputs).
fn text_inputs(phase: &Phase) -> Option<(&str, &Via)> {
    match phase {
        Phase::Queued {
            via: Via::Placed(_),
            waiting: true,
            ..
        } => None,
        Phase::Queued { node, via, .. }
        | Phase::Assigned { node, via, .. }
        | Phase::Running { node, via } => Some((node, via)),
        _ => None,
    }
}

/// The display text of a phase (None: the text does not change).
#[cfg(any(test, debug_assertions))]
fn reason_of(phase: &Phase, last: Option<&Requeue>) -> Option<String> {
    let mut s = String::new();
    reason_into(&mut s, phase, last).then_some(s)
}

/// [`reason_of`] appended to `out` (false, nothing appended: the text
/// does not change). The constant texts are copied, not formatted.
fn reason_into(out: &mut String, phase: &Phase, last: Option<&Requeue>) -> bool {
    use fmt::Write as _;
    match phase {
        Phase::Unplaced {
            why: Unplaced::Restored,
        } => return false,
        Phase::Unplaced {
            why: Unplaced::Requeued,
        } => match last {
            Some(r) => {
                let _ = write!(out, "{r}");
            }
            None => out.push_str(Unplaced::REQUEUED),
        },
        Phase::Unplaced { why: Unplaced::New } => out.push_str(Unplaced::NEW),
        Phase::Unplaced {
            why: Unplaced::NoNodes,
        } => out.push_str(Unplaced::NO_NODES),
        Phase::Unplaced { why } => {
            let _ = write!(out, "{why}");
        }
        Phase::Queued {
            node,
            via: Via::Placed(how),
            waiting: true,
        } => {
            if let Some(r) = last {
                let _ = write!(out, "{r} | ");
            }
            push_queued(out, *how, node);
        }
        Phase::Queued { node, via, .. }
        | Phase::Assigned { node, via, .. }
        | Phase::Running { node, via } => return via_text_into(out, via, node, last),
        Phase::AwaitingNode { .. } => return false,
        Phase::Done {
            end: End::Reported(m),
            ..
        } if m.is_empty() => return false,
        Phase::Done { end, .. } => {
            let _ = write!(out, "{end}");
        }
    }
    true
}

/// A job and its dispatcher-side bookkeeping.
#[derive(Clone, Debug)]
pub struct JobEntry {
    /// The record, shared with the effects that carry it (store writes,
    /// job events): a change after it was shared copies it once
    /// (`Arc::make_mut`; the spec stays shared), so an effect keeps the
    /// record as it was.
    job: Arc<JobRecord>,
    phase: Phase,
    /// The engine task that stands for it.
    pub task: TaskId,
    /// CPUs the dispatcher's model gave it on its node (dense indexes).
    pub model_cpus: Vec<LeafId>,
    /// The registry slot of the node `model_cpus` are on (None: none
    /// claimed), so that their release finds the node without its name.
    pub model_node: Option<NodeSlot>,
    /// Why it went back to PENDING, oldest first.
    pub requeues: Vec<Requeue>,
    /// `requeues.len()` when the reason text was last generated: a phase
    /// change whose text has the same inputs (see [`text_inputs`]) and no
    /// requeue since keeps the text without generating it again.
    text_requeues: usize,
}

impl JobEntry {
    /// The record (its proto: [`JobRecord::to_proto`]).
    pub fn job(&self) -> &JobRecord {
        &self.job
    }

    /// The record, shared (for an effect that carries it).
    pub fn record(&self) -> Arc<JobRecord> {
        self.job.clone()
    }

    /// Where it is and why.
    pub fn phase(&self) -> &Phase {
        &self.phase
    }

    /// Its CPUs (at least 1).
    pub fn cpus(&self) -> u32 {
        self.job.spec.as_ref().map_or(1, |s| s.cpus.max(1))
    }

    /// The GPUs it asks for.
    pub fn gpus(&self) -> u32 {
        self.job.spec.as_ref().map_or(0, |s| s.gpus)
    }

    /// A cancel was requested while it was on a node.
    pub fn cancel_requested(&self) -> bool {
        self.job.cancel_requested
    }
}

/// Fields of the proto record that do not follow from the phase, which
/// the lifecycle sets directly.
pub struct Facts<'a>(&'a mut JobRecord);

impl Facts<'_> {
    /// CPUs the agent reported.
    pub fn set_cpus(&mut self, cpus: &[u32]) {
        self.0.cpus = cpus.into();
    }

    /// GPUs the agent reported.
    pub fn set_gpus(&mut self, gpus: &[u32]) {
        self.0.gpus = gpus.into();
    }

    /// Start time, unless one is set; `0` clears it.
    pub fn set_start(&mut self, ms: i64) {
        if ms == 0 || self.0.start_time_ms == 0 {
            self.0.start_time_ms = ms;
        }
    }

    /// Exit code and signal.
    pub fn set_exit(&mut self, code: i32, signal: i32) {
        self.0.exit_code = code;
        self.0.signal = signal;
    }

    /// End time.
    pub fn set_end(&mut self, ms: i64) {
        self.0.end_time_ms = ms;
    }

    /// A new attempt.
    pub fn next_attempt(&mut self) {
        self.0.attempt += 1;
    }

    /// Record a cancel request.
    pub fn request_cancel(&mut self) {
        self.0.cancel_requested = true;
    }
}

/// The keys of the jobs in a phase that jobs pass through within one
/// operation (a new job until it is placed, a placed job until it is
/// sent), kept by lazy deletion: entering the phase appends the key,
/// leaving it only counts down `live`; a key is in the phase when its
/// job's phase says so, so readers filter (and sort, and deduplicate: a
/// job that left and came back is listed twice). The log is compacted
/// when it holds more than twice its live keys plus [`PhaseLog::SLACK`],
/// so it stays O(live) and each change O(1) amortized, where a B-tree
/// insert and remove cost ~450 instructions per job and phase.
///
/// Each key is logged with its job's slot in the table when it entered
/// the phase ([`Slab::slot_of`]): a reader asks the slot first
/// ([`Slab::get_at`], an index and a compare) and hashes the key only
/// when the slot no longer holds it. A compaction reads every key of the
/// log (~3.5 keys per job under `loadgen`): hashed, those lookups missed
/// the cache in a table of 100,000 retained jobs.
#[derive(Default)]
struct PhaseLog {
    keys: Vec<(JobKey, u32)>,
    /// Jobs in the phase now.
    live: usize,
}

impl PhaseLog {
    /// Stale keys tolerated beyond twice the live ones (few in the unit
    /// tests, so that their walks compact often).
    const SLACK: usize = if cfg!(test) { 4 } else { 64 };

    /// `key` entered the phase; its job is in slot `slot` of the table
    /// (a hint: [`PhaseLog::NO_SLOT`] when not known).
    fn add(&mut self, key: JobKey, slot: u32) {
        self.keys.push((key, slot));
        self.live += 1;
    }

    /// The slot of a key whose slot is not known.
    const NO_SLOT: u32 = u32::MAX;

    fn remove(&mut self) {
        self.live = self.live.saturating_sub(1);
    }

    fn needs_compaction(&self) -> bool {
        self.keys.len() > 2 * self.live + Self::SLACK
    }

    /// The keys in the phase (`is_in`), sorted, each once.
    fn live_keys(&self, is_in: impl Fn(JobKey, u32) -> bool) -> Vec<JobKey> {
        if self.live == 0 {
            return Vec::new();
        }
        let mut keys: Vec<JobKey> = self
            .keys
            .iter()
            .filter(|&&(k, slot)| is_in(k, slot))
            .map(|&(k, _)| k)
            .collect();
        keys.sort_unstable();
        keys.dedup();
        keys
    }

    /// Keep only the keys in the phase, once each. With none in the
    /// phase (`live` counts them exactly) every key is stale: the log is
    /// emptied in place, keeping its buffer (a job passes through these
    /// phases within one operation, so this is the usual case).
    fn compact(&mut self, is_in: impl Fn(JobKey, u32) -> bool) {
        if self.live == 0 {
            self.keys.clear();
            return;
        }
        self.keys.retain(|&(k, slot)| is_in(k, slot));
        // Sorted by key, each once (a job that left and came back is
        // listed twice; either entry finds it).
        self.keys.sort_unstable();
        self.keys.dedup_by_key(|&mut (k, _)| k);
        debug_assert_eq!(self.keys.len(), self.live, "a phase log's live count");
    }
}

/// Per node, the keys of the jobs holding it, sorted: a node holds a
/// few jobs to a few hundred, and a new job's key is the largest, so an
/// insert is a push and a removal a binary search and a short move, where
/// a B-tree node cost ~300 instructions each way. A job is listed under
/// the name its phase holds: by the name's registry slot when it has one
/// ([`NodeName::slot`]: every name the registry, the engine and so the
/// placements hand out), with no hashing of the name (its lookup by name
/// was ~120 instructions at each start and end); else (a name restored
/// from the store, or reported by an agent before its node registered)
/// by the name. One node's jobs may be in both: the readers take both
/// ([`ByNode::on`]).
#[derive(Debug, Default)]
struct ByNode {
    /// By slot (empty where a node holds nothing).
    slots: Vec<Vec<JobKey>>,
    /// By name, for names without a slot.
    names: IdMap<String, Vec<JobKey>>,
}

/// Add `key` to a sorted list.
fn add_sorted(s: &mut Vec<JobKey>, key: JobKey) {
    if s.last().is_none_or(|&l| l < key) {
        s.push(key);
    } else if let Err(at) = s.binary_search(&key) {
        s.insert(at, key);
    }
}

impl ByNode {
    /// Add `key` to the jobs holding `node`.
    fn hold(&mut self, node: &NodeName, key: JobKey) {
        match node.slot() {
            Some(slot) => {
                let i = slot as usize;
                if self.slots.len() <= i {
                    self.slots.resize_with(i + 1, Vec::new);
                }
                add_sorted(&mut self.slots[i], key);
            }
            // The node's name is copied only for its first job.
            None => match self.names.get_mut(node.as_str()) {
                Some(s) => add_sorted(s, key),
                None => {
                    self.names.insert(node.to_string(), vec![key]);
                }
            },
        }
    }

    /// Take `key` out of the jobs holding `node` (the name it was held
    /// under).
    fn unhold(&mut self, node: &NodeName, key: JobKey) {
        match node.slot() {
            Some(slot) => {
                if let Some(s) = self.slots.get_mut(slot as usize)
                    && let Ok(at) = s.binary_search(&key)
                {
                    s.remove(at);
                }
            }
            None => {
                if let Some(s) = self.names.get_mut(node.as_str()) {
                    if let Ok(at) = s.binary_search(&key) {
                        s.remove(at);
                    }
                    if s.is_empty() {
                        self.names.remove(node.as_str());
                    }
                }
            }
        }
    }

    /// The jobs holding the node `name` in registry slot `slot` (None:
    /// not registered), unordered.
    fn on(&self, name: &str, slot: Option<NodeSlot>) -> impl Iterator<Item = JobKey> + '_ {
        let by_slot = slot
            .and_then(|s| self.slots.get(s.index()))
            .map_or(&[][..], Vec::as_slice);
        let by_name = self.names.get(name).map_or(&[][..], Vec::as_slice);
        by_slot.iter().chain(by_name).copied()
    }
}

/// True when an entry of the unasked log counts: its job, in the slot
/// it names, is ASSIGNED since its `since` and not asked back.
fn is_unasked_in(table: &Slab<JobKey, JobEntry>, u: &Unasked) -> bool {
    table.get_at(u.slot, &u.key).is_some_and(|e| {
        matches!(
            e.phase,
            Phase::Assigned { since, steal_asked: None, .. } if since == u.since
        )
    })
}

/// True when `key`'s job is in a phase `is` accepts; `slot`: the slot a
/// phase log saw it in, tried first (the key is hashed only when the
/// slot no longer holds it: a key is in at most one slot, so the answer
/// is the hashed lookup's).
fn in_phase_at(
    table: &Slab<JobKey, JobEntry>,
    key: JobKey,
    slot: u32,
    is: fn(&Phase) -> bool,
) -> bool {
    match table.get_at(slot, &key) {
        Some(e) => is(&e.phase),
        None => table.get(&key).is_some_and(|e| is(&e.phase)),
    }
}

/// Jobs whose lines [`Jobs::prefetch_records`] requests together: ~13
/// lines each (record, spec, command line), so that a window being
/// dropped and the next one being fetched (~50 KB) stay in the cache
/// between their loads and their drops.
pub const PREFETCH_WINDOW: usize = 32;

/// Ask the CPU to load the cache lines of the `T` at `p` (a hint: it
/// never faults, and is nothing on other architectures).
#[inline]
fn prefetch_lines<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        let first = p as usize & !63;
        let end = p as usize + std::mem::size_of::<T>();
        for line in (first..end).step_by(64) {
            // SAFETY: a prefetch is a hint that neither reads memory into
            // the program nor faults, whatever the address.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(line as *const i8) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// `gpus` GPUs of a job leave `node` (`Jobs::gpus_by_node`).
fn untake_gpus(gpus_by_node: &mut IdMap<String, u32>, node: &str, gpus: u32) {
    if let Some(n) = gpus_by_node.get_mut(node) {
        *n = n.saturating_sub(gpus);
        if *n == 0 {
            gpus_by_node.remove(node);
        }
    }
}

/// `Unplaced::New`: the phase of [`Jobs::fresh`].
fn is_fresh(p: &Phase) -> bool {
    matches!(p, Phase::Unplaced { why: Unplaced::New })
}

/// `Queued` and not waiting: the phase of [`Jobs::starting`].
fn is_starting(p: &Phase) -> bool {
    matches!(p, Phase::Queued { waiting: false, .. })
}

/// One entry of [`UnaskedLog`]: a job sent at `since`, and its slot in
/// the job table when it was (checked against the key before use).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Unasked {
    since: i64,
    key: JobKey,
    slot: u32,
}

impl Unasked {
    /// The order of the log.
    fn at(&self) -> (i64, JobKey) {
        (self.since, self.key)
    }
}

/// The ASSIGNED jobs not asked back, as `(since, key)` in order, kept by
/// lazy deletion like [`PhaseLog`]: a job sent appends (its `since` is
/// the latest, but for a restored or out-of-order time, inserted in
/// place), a job leaving only counts down `live`; an entry counts while
/// its job is still `Assigned` with that `since` and not asked back. An
/// entry carries its job's slot in the table, so that compaction checks
/// each entry with an index and a key compare ([`Slab::get_at`]), where
/// a hashed lookup per entry cost ~250 instructions per job sent.
#[derive(Default)]
struct UnaskedLog {
    entries: VecDeque<Unasked>,
    live: usize,
}

impl UnaskedLog {
    fn add(&mut self, since: i64, key: JobKey, slot: u32) {
        let e = Unasked { since, key, slot };
        if self.entries.back().is_none_or(|b| b.at() <= e.at()) {
            self.entries.push_back(e);
        } else {
            let at = self.entries.partition_point(|x| x.at() <= e.at());
            self.entries.insert(at, e);
        }
        self.live += 1;
    }

    fn remove(&mut self) {
        self.live = self.live.saturating_sub(1);
    }

    fn needs_compaction(&self) -> bool {
        self.entries.len() > 2 * self.live + PhaseLog::SLACK
    }

    /// Keep only the entries that count (`is_in`), once each.
    fn compact(&mut self, is_in: impl Fn(&Unasked) -> bool) {
        self.entries.retain(|e| is_in(e));
        // Sorted: a duplicate (a job asked back and cleared again) is
        // next to its twin.
        let mut last = None;
        self.entries
            .retain(|e| last.replace(e.at()) != Some(e.at()));
        debug_assert_eq!(
            self.entries.len(),
            self.live,
            "the unasked log's live count"
        );
    }
}

/// The text of the last placement made on an engine leaf
/// ([`Jobs::queue_new`]): "{how} -> {node}", with no history.
#[derive(Clone, Debug)]
struct PlacedText {
    how: Placement,
    text: Text,
    /// The length of the part before the node's name.
    prefix: usize,
}

impl PlacedText {
    /// True when it is the text of `how` on `node`: the same `how` makes
    /// the same `prefix` bytes, so the text is for `node` when the rest
    /// is `node`.
    fn is_for(&self, how: Placement, node: &str) -> bool {
        let t = self.text.as_str();
        self.how == how && t.len() == self.prefix + node.len() && t.ends_with(node)
    }
}

/// Reason texts [`Jobs`] keeps to share: a few, since the elements of an
/// array take turns ("submitted" for each, then each is placed).
const RECENT_TEXTS: usize = 4;

/// The last reason texts set (a ring): a job given one of the same texts
/// (an array's elements, placed one after the other) shares it.
#[derive(Default)]
struct RecentTexts {
    texts: [Text; RECENT_TEXTS],
    /// The ring's next slot.
    next: usize,
}

impl RecentTexts {
    /// The shared copy of `t`: one in the ring, else a new one put there.
    fn share(&mut self, t: &str) -> Text {
        match self.texts.iter().find(|r| **r == *t) {
            Some(r) => r.clone(),
            None => {
                let text = Text::from(t);
                self.texts[self.next] = text.clone();
                self.next = (self.next + 1) % RECENT_TEXTS;
                text
            }
        }
    }
}

/// The job table and its indexes.
#[derive(Default)]
pub struct Jobs {
    /// Every job, by key: hashed for lookups, ordered for listings.
    table: Slab<JobKey, JobEntry>,
    task_job: IdMap<TaskId, JobKey>,
    next_job: u64,
    next_task: u64,
    /// Per node, the keys of the jobs holding it ([`ByNode`]).
    by_node: ByNode,
    awaiting: BTreeSet<JobKey>,
    /// Unplaced jobs but the new ones (`Unplaced::New`, in `fresh`).
    unplaced: BTreeSet<JobKey>,
    /// Queued jobs waiting in their node's queue (the others, about to
    /// be sent, in `starting`).
    queued: BTreeSet<JobKey>,
    /// Jobs just accepted, not placed yet (`Unplaced::New`): a phase a
    /// job leaves within its submit.
    fresh: PhaseLog,
    /// Queued jobs that the engine started (`waiting: false`): a phase a
    /// placed job leaves when the operation's events are processed.
    starting: PhaseLog,
    /// ASSIGNED jobs not asked back (`steal_asked: None`), by `since`.
    unasked: UnaskedLog,
    /// GPUs taken per node by the jobs whose phase names it.
    gpus_by_node: IdMap<String, u32>,
    /// A job's GPUs left a node since [`Jobs::take_gpus_freed`].
    gpus_freed: bool,
    /// Terminal jobs are queued for [`Jobs::expired`].
    retained: bool,
    /// Bumped by every change to the table or an entry ([`Jobs::changes`]).
    changes: u64,
    /// Jobs that became terminal since the last [`Jobs::expired`] call,
    /// with their record's end time then (0: none, stamped at that
    /// call), read where the change has the record at hand: the
    /// retention never looks a job up again until it may forget it.
    done_new: Vec<(i64, JobKey)>,
    /// Terminal jobs by when they ended (ms, non-decreasing), oldest
    /// first: the retention's queue.
    done: VecDeque<(i64, JobKey)>,
    /// The selector of the last `NoMatch` phase set: the jobs of an
    /// array (or of one workload) that no node matches share it.
    no_match: Option<Arc<BTreeMap<String, String>>>,
    /// The last reason texts set, shared by the jobs given the same one.
    recent_texts: RecentTexts,
    /// The text of every new job ([`Unplaced::NEW`]), made once.
    fresh_text: Option<Text>,
    /// Per engine leaf, the text of the last placement made there
    /// ([`Jobs::queue_new`]).
    placed_texts: Vec<Option<PlacedText>>,
    /// The buffer a phase change writes its reason text into (kept: a
    /// placement's text was a new `String`, copied into the record's
    /// `Text` and freed).
    scratch: String,
}

impl Jobs {
    /// An empty table; job numbers start at 1. `retained`: terminal
    /// jobs are queued for [`Jobs::expired`] (else they are kept).
    pub fn new(retained: bool) -> Self {
        Self {
            next_job: 1,
            next_task: 1,
            retained,
            ..Default::default()
        }
    }

    /// Number of jobs (all phases).
    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// True without jobs.
    pub fn is_empty(&self) -> bool {
        self.table.len() == 0
    }

    /// A counter bumped by every change to the table or to an entry (its
    /// phase, facts, modelled CPUs, requeues): equal counters, no change
    /// in between (the gang pass skips on it).
    pub fn changes(&self) -> u64 {
        self.changes
    }

    /// The next job number.
    pub fn next_number(&self) -> u64 {
        self.next_job
    }

    /// Set the next job number (restore).
    pub fn set_next_number(&mut self, n: u64) {
        self.next_job = n.max(1);
    }

    /// Take a job number.
    pub fn take_number(&mut self) -> u64 {
        let n = self.next_job;
        self.next_job += 1;
        n
    }

    /// One job.
    pub fn get(&self, key: JobKey) -> Option<&JobEntry> {
        self.table.get(&key)
    }

    /// True when `key` is a job.
    pub fn contains(&self, key: JobKey) -> bool {
        self.table.contains_key(&key)
    }

    /// The job of an engine task.
    pub fn of_task(&self, task: TaskId) -> Option<JobKey> {
        self.task_job.get(&task).copied()
    }

    /// All jobs in key order.
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = (JobKey, &JobEntry)> {
        self.table.iter().map(|(k, e)| (*k, e))
    }

    /// Jobs with keys below `upper`, newest first.
    pub fn below(&self, upper: JobKey) -> impl Iterator<Item = (JobKey, &JobEntry)> {
        self.table.range(..upper).rev().map(|(k, e)| (*k, e))
    }

    /// The elements of array `key` (none for a plain job).
    pub fn elements(&self, key: JobKey) -> impl Iterator<Item = JobKey> + '_ {
        self.table.range(key.elements()).map(|(k, _)| *k)
    }

    /// Jobs holding `node` (ASSIGNED or RUNNING, restored or not), in key
    /// order; `slot`: the node's registry slot (None: not registered).
    pub fn on(&self, node: &str, slot: Option<NodeSlot>) -> Vec<JobKey> {
        let mut keys: Vec<JobKey> = self.by_node.on(node, slot).collect();
        keys.sort_unstable();
        keys
    }

    /// [`Jobs::on`], unordered and borrowed (nothing allocated).
    pub fn keys_on(&self, node: &str, slot: Option<NodeSlot>) -> impl Iterator<Item = JobKey> + '_ {
        self.by_node.on(node, slot)
    }

    /// CPUs held on `node` (in registry slot `slot`) by its ASSIGNED and
    /// RUNNING jobs.
    pub fn cpus_held(&self, node: &str, slot: Option<NodeSlot>) -> u32 {
        self.by_node
            .on(node, slot)
            .filter_map(|k| self.table.get(&k))
            .map(JobEntry::cpus)
            .sum()
    }

    /// GPUs taken on `node` by the jobs queued, assigned or running there.
    pub fn gpus_on(&self, node: &str) -> u32 {
        self.gpus_by_node.get(node).copied().unwrap_or(0)
    }

    /// Whether [`Jobs::take_gpus_freed`] would answer true, without
    /// taking it.
    pub fn gpus_freed(&self) -> bool {
        self.gpus_freed
    }

    /// True (once) when some job's GPUs left a node since the last call.
    pub fn take_gpus_freed(&mut self) -> bool {
        std::mem::take(&mut self.gpus_freed)
    }

    /// ASSIGNED jobs not asked back, sent at or before `since_at_most`,
    /// in key order (the agent-level steal's candidates): O(log n + k).
    pub fn unasked_since(&self, since_at_most: i64) -> Vec<JobKey> {
        let mut keys: Vec<JobKey> = self
            .unasked
            .entries
            .iter()
            .take_while(|e| e.since <= since_at_most)
            .filter(|e| self.is_unasked(e))
            .map(|e| e.key)
            .collect();
        keys.sort_unstable();
        keys.dedup();
        keys
    }

    /// True when an entry of the unasked log counts: its job (in its
    /// slot) is ASSIGNED since `since` and not asked back.
    fn is_unasked(&self, u: &Unasked) -> bool {
        is_unasked_in(&self.table, u)
    }

    /// Restored jobs whose node has not reported them.
    pub fn awaiting(&self) -> Vec<JobKey> {
        self.awaiting.iter().copied().collect()
    }

    /// True when `key`'s job is in a phase `is` accepts.
    fn in_phase(&self, key: JobKey, slot: u32, is: fn(&Phase) -> bool) -> bool {
        in_phase_at(&self.table, key, slot, is)
    }

    /// The keys of an index and of a phase log, in key order.
    fn merged(
        &self,
        set: &BTreeSet<JobKey>,
        log: &PhaseLog,
        is: fn(&Phase) -> bool,
    ) -> Vec<JobKey> {
        let extra = log.live_keys(|k, slot| self.in_phase(k, slot, is));
        if extra.is_empty() {
            return set.iter().copied().collect();
        }
        let mut keys: Vec<JobKey> = set.iter().copied().chain(extra).collect();
        keys.sort_unstable();
        keys
    }

    /// PENDING jobs not in the engine.
    pub fn unplaced(&self) -> Vec<JobKey> {
        self.merged(&self.unplaced, &self.fresh, is_fresh)
    }

    /// PENDING jobs in the engine.
    pub fn queued(&self) -> Vec<JobKey> {
        self.merged(&self.queued, &self.starting, is_starting)
    }

    /// The `n` oldest PENDING jobs (lowest keys), unplaced or queued.
    pub fn oldest_pending(&self, n: usize) -> Vec<JobKey> {
        let mut keys: Vec<JobKey> = self.unplaced.iter().take(n).copied().collect();
        keys.extend(self.queued.iter().take(n));
        keys.extend(
            self.fresh
                .live_keys(|k, slot| self.in_phase(k, slot, is_fresh)),
        );
        keys.extend(
            self.starting
                .live_keys(|k, slot| self.in_phase(k, slot, is_starting)),
        );
        keys.sort_unstable();
        keys.truncate(n);
        keys
    }

    /// Add a job in `phase` with a fresh engine task. Inline: the record
    /// is passed by value, and a call copied it once more.
    #[inline]
    pub fn insert(&mut self, key: JobKey, job: JobRecord, phase: Phase) {
        if is_fresh(&phase) {
            self.insert_new(key, job);
        } else {
            self.insert_general(key, job, phase);
        }
    }

    /// [`Jobs::insert`] of a new job (`Unplaced::New`, every submitted
    /// job): its record gets the phase's state and shared text before it
    /// is shared, and the entry its phase at once, where the general path
    /// inserted a placeholder, then replaced it through `write_phase`
    /// (~300 instructions per job). Same entry, record and indexes.
    fn insert_new(&mut self, key: JobKey, mut job: JobRecord) {
        self.changes += 1;
        let task = TaskId(self.next_task);
        self.next_task += 1;
        self.task_job.insert(task, key);
        // As `write_phase_as` sets them: the state, the node of an
        // unplaced job (none) and the shared "submitted".
        job.state = JobState::Pending as i32;
        if !job.node.is_empty() {
            job.node = NodeName::default();
        }
        if job.reason != *Unplaced::NEW {
            job.reason = self
                .fresh_text
                .get_or_insert_with(|| Text::from(Unplaced::NEW))
                .clone();
        }
        self.table.insert(
            key,
            JobEntry {
                job: Arc::new(job),
                phase: Phase::Unplaced { why: Unplaced::New },
                task,
                model_cpus: Vec::new(),
                model_node: None,
                requeues: Vec::new(),
                text_requeues: 0,
            },
        );
        // The insert left the hint on the new slot.
        let slot = self.table.slot_of(&key).unwrap_or(PhaseLog::NO_SLOT);
        self.fresh.add(key, slot);
        self.compact_logs();
    }

    /// [`Jobs::insert`] in any phase: the entry in a placeholder phase,
    /// then `phase` written as a phase change writes it.
    fn insert_general(&mut self, key: JobKey, job: JobRecord, phase: Phase) {
        self.changes += 1;
        let task = TaskId(self.next_task);
        self.next_task += 1;
        self.task_job.insert(task, key);
        let gpus = job.spec.as_ref().map_or(0, |s| s.gpus);
        let end = job.end_time_ms;
        self.table.insert(
            key,
            JobEntry {
                job: Arc::new(job),
                phase: Phase::Unplaced {
                    why: Unplaced::Restored,
                },
                task,
                model_cpus: Vec::new(),
                model_node: None,
                requeues: Vec::new(),
                text_requeues: 0,
            },
        );
        self.index(key, &phase, gpus);
        if self.retained && phase.is_done() {
            self.done_new.push((end, key));
        }
        self.write_phase(key, phase);
        self.compact_logs();
    }

    /// Compact the phase logs that need it (the table's phases must be
    /// current: not inside [`Jobs::set_phase`]'s swap).
    fn compact_logs(&mut self) {
        let table = &self.table;
        let is_in =
            |is: fn(&Phase) -> bool| move |k: JobKey, slot: u32| in_phase_at(table, k, slot, is);
        if self.fresh.needs_compaction() {
            self.fresh.compact(is_in(is_fresh));
        }
        if self.starting.needs_compaction() {
            self.starting.compact(is_in(is_starting));
        }
        if self.unasked.needs_compaction() {
            let table = &self.table;
            self.unasked.compact(|u| is_unasked_in(table, u));
        }
    }

    /// Terminal jobs whose retention is over at `now`: those that ended
    /// at least `min_age_ms` ago, then the oldest beyond `max_kept`
    /// terminal jobs, oldest first. A job ends at its record's end time
    /// (else when this first sees it terminal); a gang member is not
    /// returned while a member of its gang has not ended (it is kept,
    /// and looked at again as if it had ended now). The caller removes
    /// the jobs returned.
    pub fn expired(&mut self, now: i64, min_age_ms: i64, max_kept: usize) -> Vec<JobKey> {
        // Stamped as they came (a job forgotten or no longer terminal
        // since is skipped when it comes out, below).
        let mut stamped = std::mem::take(&mut self.done_new);
        for (end, _) in &mut stamped {
            *end = if *end > 0 { (*end).min(now) } else { now };
        }
        stamped.sort_unstable();
        // Non-decreasing: a job stamped earlier than the last one queued
        // (a restored end time) waits as long as that one.
        let mut last = self.done.back().map_or(i64::MIN, |d| d.0);
        for &(t, k) in &stamped {
            last = last.max(t);
            self.done.push_back((last, k));
        }
        stamped.clear();
        self.done_new = stamped;
        let mut out = Vec::new();
        let mut kept = Vec::new();
        let mut left = self.done.len();
        while left > 0
            && let Some(&(t, key)) = self.done.front()
        {
            if t > now.saturating_sub(min_age_ms) && self.done.len() + kept.len() <= max_kept {
                break;
            }
            left -= 1;
            self.done.pop_front();
            let Some(e) = self.table.get(&key) else {
                continue;
            };
            if !e.phase.is_done() {
                continue;
            }
            // A plain job's key has no element (no record to read).
            let gang_alive = !key.is_single()
                && e.job.is_gang()
                && self
                    .table
                    .range(key.array().elements())
                    .any(|(_, m)| !m.phase.is_done());
            if gang_alive {
                kept.push((now, key));
            } else {
                out.push(key);
            }
        }
        for k in kept {
            let t = self.done.back().map_or(k.0, |d| d.0.max(k.0));
            self.done.push_back((t, k.1));
        }
        out
    }

    /// Start loading the records and specs of the jobs `keys` (the ones
    /// [`Jobs::expired`] returned, which the caller removes and drops next)
    /// into the cache, a window's worth at a time ([`PREFETCH_WINDOW`]
    /// keys; the caller hands over one window while it drops the one
    /// before). Each job was last touched when it ended, up to the
    /// retention's 100,000 jobs ago, so each line is a miss; fetched one
    /// job after the other, each drop waited for its record, then for its
    /// spec behind it. Issued together the misses overlap. A hint only;
    /// what is read here is what the next pass needs the address from:
    /// the entries (which `expired` has just read), then each record's
    /// spec pointer, then each spec's command line, each pass once the
    /// previous one's loads were issued.
    pub fn prefetch_records(&self, keys: &[JobKey]) {
        for keys in keys.chunks(PREFETCH_WINDOW) {
            // Looked up once for the three passes, without allocating.
            let mut found: [Option<&JobEntry>; PREFETCH_WINDOW] = [None; PREFETCH_WINDOW];
            for (e, k) in found.iter_mut().zip(keys) {
                *e = self.table.get(k);
            }
            let entries = || found.iter().flatten();
            for e in entries() {
                prefetch_lines(Arc::as_ptr(&e.job));
            }
            for e in entries() {
                if let Some(spec) = &e.job.spec {
                    prefetch_lines(Arc::as_ptr(spec));
                }
            }
            for spec in entries().filter_map(|e| e.job.spec.as_ref()) {
                prefetch_lines(spec.command.as_ptr());
                // The first arguments' bytes (a job's command has a few;
                // the rest, if any, miss as before).
                for arg in spec.command.iter().take(4) {
                    prefetch_lines(arg.as_ptr());
                }
            }
        }
    }

    /// Forget a job: its record, its indexes and its engine task's
    /// mapping (the caller has taken the task out of the engine).
    pub fn remove(&mut self, key: JobKey) -> Option<JobEntry> {
        self.changes += 1;
        let e = self.table.remove(&key)?;
        let gpus = e.gpus();
        self.unindex(key, &e.phase, gpus);
        self.task_job.remove(&e.task);
        self.compact_logs();
        Some(e)
    }

    /// Move a job to `phase`: the indexes, its state, node and reason
    /// follow. Returns the state it had.
    pub fn set_phase(&mut self, key: JobKey, phase: Phase) -> JobState {
        self.replace_phase(key, phase)
            .map_or(JobState::Unspecified, |p| p.state())
    }

    /// [`Jobs::set_phase`], returning the phase it had (None: no such
    /// job), whose strings the caller may reuse.
    pub fn replace_phase(&mut self, key: JobKey, phase: Phase) -> Option<Phase> {
        self.changes += 1;
        match self.end_in_place(key, phase) {
            Ok(previous) => Some(previous),
            Err(phase) => self.replace_phase_general(key, phase),
        }
    }

    /// A job ASSIGNED or RUNNING on its node ends with no message
    /// (`Done` with an empty `End::Reported`, an agent's usual report):
    /// [`Jobs::replace_phase`] in place. The new phase has no node and no
    /// text (the record keeps its node and reason), and no index holds a
    /// terminal job, so only the previous phase's entries go (`by_node`,
    /// `gpus_by_node`, the unasked log's count), the record's state is
    /// set and the retention queue takes the job. `Err(phase)`, nothing
    /// done: another change, for the general path.
    fn end_in_place(&mut self, key: JobKey, phase: Phase) -> Result<Phase, Phase> {
        let Phase::Done {
            end: End::Reported(message),
            ..
        } = &phase
        else {
            return Err(phase);
        };
        if !message.is_empty() {
            return Err(phase);
        }
        let Some(e) = self.table.get_mut(&key) else {
            return Err(phase);
        };
        if !matches!(e.phase, Phase::Assigned { .. } | Phase::Running { .. }) {
            return Err(phase);
        }
        let state = phase.state() as i32;
        let gpus = e.gpus();
        let previous = std::mem::replace(&mut e.phase, phase);
        // As the general path's text step: generated (to nothing) now.
        e.text_requeues = e.requeues.len();
        if e.job.state != state {
            Arc::make_mut(&mut e.job).state = state;
        }
        let end = e.job.end_time_ms;
        if matches!(
            previous,
            Phase::Assigned {
                steal_asked: None,
                ..
            }
        ) {
            self.unasked.remove();
        }
        if let Some(node) = previous.holds_name() {
            if gpus > 0 {
                self.gpus_freed = true;
                untake_gpus(&mut self.gpus_by_node, node, gpus);
            }
            self.by_node.unhold(node, key);
        }
        if self.retained {
            self.done_new.push((end, key));
        }
        self.compact_logs();
        Ok(previous)
    }

    /// [`Jobs::replace_phase`] for any change: the previous phase's
    /// indexes out, the new one's in, the record derived again.
    fn replace_phase_general(&mut self, key: JobKey, mut phase: Phase) -> Option<Phase> {
        if let Phase::Unplaced {
            why: Unplaced::NoMatch { selector, .. },
        } = &mut phase
        {
            match &self.no_match {
                Some(s) if s == selector => *selector = s.clone(),
                _ => self.no_match = Some(selector.clone()),
            }
        }
        let e = self.table.get_mut(&key)?;
        // Taken, not cloned (its strings); `write_phase` sets the new one.
        let placeholder = Phase::Unplaced {
            why: Unplaced::Restored,
        };
        let previous = std::mem::replace(&mut e.phase, placeholder);
        let gpus = e.gpus();
        if gpus > 0 && previous.node().is_some() && previous.node() != phase.node() {
            self.gpus_freed = true;
        }
        let end = e.job.end_time_ms;
        self.unindex(key, &previous, gpus);
        self.index(key, &phase, gpus);
        if self.retained && phase.is_done() && !previous.is_done() {
            self.done_new.push((end, key));
        }
        let same_text =
            text_inputs(&previous).is_some() && text_inputs(&previous) == text_inputs(&phase);
        self.write_phase_as(key, phase, same_text);
        self.compact_logs();
        Some(previous)
    }

    /// The record of a job, shared (for an effect that carries it: a
    /// store write, a job event).
    pub fn record(&self, key: JobKey) -> Option<Arc<JobRecord>> {
        self.table.get(&key).map(|e| e.job.clone())
    }

    /// The proto fields that do not follow from the phase.
    pub fn facts(&mut self, key: JobKey) -> Option<Facts<'_>> {
        self.changes += 1;
        self.table
            .get_mut(&key)
            .map(|e| Facts(Arc::make_mut(&mut e.job)))
    }

    /// Its modelled CPUs and the slot of their node, to change. Inline:
    /// a table lookup, called at every placement's claim and release.
    #[inline]
    pub fn model_mut(&mut self, key: JobKey) -> Option<(&mut Vec<LeafId>, &mut Option<NodeSlot>)> {
        self.changes += 1;
        self.table
            .get_mut(&key)
            .map(|e| (&mut e.model_cpus, &mut e.model_node))
    }

    /// Record why a job goes back to PENDING.
    pub fn push_requeue(&mut self, key: JobKey, r: Requeue) {
        self.changes += 1;
        if let Some(e) = self.table.get_mut(&key) {
            e.requeues.push(r);
        }
    }

    /// Mark an ASSIGNED job as asked back (`Steal`) at `now`, or clear it.
    pub fn set_steal_asked(&mut self, key: JobKey, at: Option<i64>) {
        self.changes += 1;
        if let Some(slot) = self.table.slot_of(&key)
            && let Some(e) = self.table.get_mut(&key)
            && let Phase::Assigned {
                steal_asked, since, ..
            } = &mut e.phase
        {
            match (steal_asked.is_some(), at.is_some()) {
                (false, true) => self.unasked.remove(),
                (true, false) => self.unasked.add(*since, key, slot),
                _ => {}
            }
            *steal_asked = at;
        }
        self.compact_logs();
    }

    fn write_phase(&mut self, key: JobKey, phase: Phase) {
        self.write_phase_as(key, phase, false);
    }

    /// [`Self::write_phase`]; `same_text`: the previous phase's reason
    /// had the same inputs ([`text_inputs`]), so unless a requeue was
    /// recorded since, the text is kept without being generated (a
    /// placement's QUEUED -> ASSIGNED -> RUNNING say the same).
    fn write_phase_as(&mut self, key: JobKey, phase: Phase, same_text: bool) {
        let Some(e) = self.table.get_mut(&key) else {
            return;
        };
        let keep_text = same_text && e.text_requeues == e.requeues.len();
        let state = phase.state() as i32;
        let none = NodeName::default();
        let node = match &phase {
            Phase::Unplaced {
                why: Unplaced::Restored,
            }
            | Phase::Done { .. } => None,
            Phase::Unplaced { .. } => Some(&none),
            p => p.node_name(),
        }
        .filter(|n| e.job.node != **n);
        let text = if keep_text {
            #[cfg(debug_assertions)]
            if let Some(t) = gang_text(&phase, &e.job, e.requeues.last())
                .or_else(|| reason_of(&phase, e.requeues.last()))
            {
                debug_assert_eq!(e.job.reason, t, "{key}: a kept reason text changed");
            }
            None
        } else if is_fresh(&phase) {
            // A new job's text, "submitted" (no history, no gang text):
            // one shared copy, not generated and looked up in the ring.
            e.text_requeues = e.requeues.len();
            (e.job.reason != *Unplaced::NEW).then(|| {
                self.fresh_text
                    .get_or_insert_with(|| Text::from(Unplaced::NEW))
                    .clone()
            })
        } else {
            e.text_requeues = e.requeues.len();
            let t = &mut self.scratch;
            t.clear();
            let some = match gang_text(&phase, &e.job, e.requeues.last()) {
                Some(g) => {
                    t.push_str(&g);
                    true
                }
                None => reason_into(t, &phase, e.requeues.last()),
            };
            (some && e.job.reason != *t.as_str()).then(|| self.recent_texts.share(t))
        };
        // The record is copied (when an effect shares it) only if it
        // changes.
        if e.job.state != state || node.is_some() || text.is_some() {
            let job = Arc::make_mut(&mut e.job);
            job.state = state;
            if let Some(n) = node {
                job.node = n.clone();
            }
            if let Some(text) = text {
                job.reason = text;
            }
        }
        e.phase = phase;
    }

    /// Add `key` to (or take it out of) the indexes of `phase`; `gpus`:
    /// the GPUs the job asks (passed in: looking it up here searched the
    /// whole table twice per phase change).
    fn sets(&mut self, key: JobKey, phase: &Phase, add: bool, gpus: u32) {
        let slot =
            |table: &Slab<JobKey, JobEntry>| table.slot_of(&key).unwrap_or(PhaseLog::NO_SLOT);
        let log = if is_fresh(phase) {
            Some(&mut self.fresh)
        } else if is_starting(phase) {
            Some(&mut self.starting)
        } else {
            None
        };
        if let Some(log) = log {
            if add {
                log.add(key, slot(&self.table));
            } else {
                log.remove();
            }
        }
        let set = match phase {
            _ if is_fresh(phase) || is_starting(phase) => None,
            Phase::Unplaced { .. } => Some(&mut self.unplaced),
            Phase::Queued { .. } => Some(&mut self.queued),
            Phase::AwaitingNode { .. } => Some(&mut self.awaiting),
            Phase::Assigned { .. } | Phase::Running { .. } | Phase::Done { .. } => None,
        };
        if let Some(set) = set {
            if add {
                set.insert(key);
            } else {
                set.remove(&key);
            }
        }
        if let Phase::Assigned {
            since,
            steal_asked: None,
            ..
        } = phase
        {
            if add {
                if let Some(slot) = self.table.slot_of(&key) {
                    self.unasked.add(*since, key, slot);
                }
            } else {
                self.unasked.remove();
            }
        }
        if gpus > 0
            && let Some(node) = phase.node()
        {
            if add {
                match self.gpus_by_node.get_mut(node) {
                    Some(n) => *n += gpus,
                    None => {
                        self.gpus_by_node.insert(node.to_string(), gpus);
                    }
                }
            } else {
                untake_gpus(&mut self.gpus_by_node, node, gpus);
            }
        }
        if let Some(node) = phase.holds_name() {
            if add {
                self.by_node.hold(node, key);
            } else {
                self.by_node.unhold(node, key);
            }
        }
    }

    /// The engine started `key`'s job where it was queued to be sent
    /// (`Queued` on `node`, not waiting): it becomes `Assigned` there
    /// since `now`, not asked back, with its Queued phase's way, exactly
    /// as [`Jobs::set_phase`] makes it, but in place: the Queued phase's
    /// node name and way move into the new phase, and only what differs
    /// is touched (the starting log, the unasked log, `by_node`, the
    /// record's state). Its reason text stays (the same inputs and no
    /// requeue since: [`text_inputs`]), and so does the record's node
    /// (the Queued phase's). Every placement that starts at once passes
    /// here, where the general path replaced, compared and re-derived
    /// everything. False, nothing done: the job is not in that phase, or
    /// its text must be generated again (a requeue was recorded since):
    /// the caller takes the general path.
    pub fn assign_started(&mut self, key: JobKey, node: &NodeName, now: i64) -> bool {
        self.changes += 1;
        let Some(slot) = self.table.slot_of(&key) else {
            return false;
        };
        let Some(e) = self.table.get_mut(&key) else {
            return false;
        };
        let Phase::Queued {
            node: queued_on,
            via,
            waiting: false,
        } = &mut e.phase
        else {
            return false;
        };
        // One node's names are one allocation: no text compared.
        if *queued_on != *node || e.text_requeues != e.requeues.len() {
            return false;
        }
        e.phase = Phase::Assigned {
            node: std::mem::take(queued_on),
            since: now,
            steal_asked: None,
            via: std::mem::replace(via, Via::Restored),
        };
        let state = JobState::Assigned as i32;
        if e.job.state != state {
            Arc::make_mut(&mut e.job).state = state;
        }
        debug_assert_eq!(e.job.node, *node, "{key}: the record's node");
        #[cfg(debug_assertions)]
        if let Some(t) = gang_text(&e.phase, &e.job, e.requeues.last())
            .or_else(|| reason_of(&e.phase, e.requeues.last()))
        {
            debug_assert_eq!(e.job.reason, t, "{key}: a kept reason text changed");
        }
        // Out of `starting` (its log counts down), into `unasked` and
        // `by_node`; `gpus_by_node` names the same node before and after.
        self.starting.remove();
        self.unasked.add(now, key, slot);
        if let Phase::Assigned { node, .. } = &e.phase {
            self.by_node.hold(node, key);
        }
        self.compact_logs();
        true
    }

    /// A new job (`Unplaced::New`) placed by the engine on `node`:
    /// `Queued { node, via: Placed(how), waiting }`, exactly as
    /// [`Jobs::set_phase`] makes it, but in place: out of `fresh` (its log
    /// counts down), into `starting` (or `queued` when it waits) and
    /// `gpus_by_node`; the record takes the node and the reason text.
    /// Every placement of a new job passes here, where the general path
    /// swapped in a placeholder, took the job out of every index and put
    /// it back, and compared the phases' text inputs. The text of a
    /// placement that starts at once, with no history, is "{how} ->
    /// {node}", which the placements on one node share: the last one made
    /// for the engine leaf `leaf` is reused when it is for the same `how`
    /// and node (checked on the text itself, so a stale `leaf` after an
    /// engine rebuild only misses), where it was generated, looked up in
    /// the ring of recent texts and allocated each time (~250
    /// instructions). `Err(node)`, nothing done: not a new job, or a gang
    /// member (the gang's text): the caller takes the general path.
    pub fn queue_new(
        &mut self,
        key: JobKey,
        node: NodeName,
        how: Placement,
        waiting: bool,
        leaf: usize,
    ) -> Result<(), NodeName> {
        // Its slot for the `starting` log (the lookup leaves the hint on
        // it for the next).
        let Some(slot) = self.table.slot_of(&key) else {
            return Err(node);
        };
        let Some(e) = self.table.get_mut(&key) else {
            return Err(node);
        };
        if !is_fresh(&e.phase) || e.job.is_gang() {
            return Err(node);
        }
        self.changes += 1;
        let gpus = e.gpus();
        // The reason text, as `write_phase_as` derives it (`reason_into`
        // of the Queued phase).
        e.text_requeues = e.requeues.len();
        let last = e.requeues.last();
        let cached = match last {
            None if !waiting => self
                .placed_texts
                .get(leaf)
                .and_then(Option::as_ref)
                .filter(|c| c.is_for(how, &node))
                .map(|c| c.text.clone()),
            _ => None,
        };
        let text = match cached {
            Some(text) => text,
            None => {
                let t = &mut self.scratch;
                t.clear();
                if waiting {
                    if let Some(r) = last {
                        use fmt::Write as _;
                        let _ = write!(t, "{r} | ");
                    }
                    push_queued(t, how, &node);
                } else {
                    via_text_into(t, &Via::Placed(how), &node, last);
                }
                if e.job.reason == *t.as_str() {
                    e.job.reason.clone()
                } else if last.is_none() && !waiting {
                    // The leaf's text from now on.
                    let text = Text::from(t.as_str());
                    if self.placed_texts.len() <= leaf {
                        self.placed_texts.resize(leaf + 1, None);
                    }
                    self.placed_texts[leaf] = Some(PlacedText {
                        how,
                        text: text.clone(),
                        prefix: t.len() - node.len(),
                    });
                    text
                } else {
                    self.recent_texts.share(t)
                }
            }
        };
        let text = (e.job.reason != text).then_some(text);
        let renode = e.job.node != node;
        if e.job.state != JobState::Pending as i32 || renode || text.is_some() {
            let job = Arc::make_mut(&mut e.job);
            job.state = JobState::Pending as i32;
            if renode {
                job.node = node.clone();
            }
            if let Some(text) = text {
                job.reason = text;
            }
        }
        self.fresh.remove();
        if waiting {
            self.queued.insert(key);
        } else {
            self.starting.add(key, slot);
        }
        if gpus > 0 {
            match self.gpus_by_node.get_mut(node.as_str()) {
                Some(n) => *n += gpus,
                None => {
                    self.gpus_by_node.insert(node.to_string(), gpus);
                }
            }
        }
        e.phase = Phase::Queued {
            node,
            via: Via::Placed(how),
            waiting,
        };
        self.compact_logs();
        Ok(())
    }

    fn index(&mut self, key: JobKey, phase: &Phase, gpus: u32) {
        self.sets(key, phase, true, gpus);
    }

    fn unindex(&mut self, key: JobKey, phase: &Phase, gpus: u32) {
        self.sets(key, phase, false, gpus);
    }

    /// Check the invariants against a brute-force recomputation over the
    /// whole table: each index holds exactly the jobs of its phases, and
    /// each proto record agrees with its phase.
    pub fn check(&self) -> Result<(), String> {
        let mut by_node: BTreeMap<Result<u32, String>, Vec<JobKey>> = BTreeMap::new();
        let (mut awaiting, mut unplaced, mut queued) =
            (BTreeSet::new(), BTreeSet::new(), BTreeSet::new());
        let mut unasked = BTreeSet::new();
        let mut gpus_by_node: HashMap<String, u32> = HashMap::new();
        self.table.check()?;
        for (&key, e) in self.table.iter() {
            let p = &e.phase;
            if let Some(n) = p.node()
                && e.gpus() > 0
            {
                *gpus_by_node.entry(n.to_string()).or_default() += e.gpus();
            }
            if let Phase::Assigned {
                since,
                steal_asked: None,
                ..
            } = p
            {
                unasked.insert((*since, key));
            }
            match p {
                Phase::Unplaced { .. } => unplaced.insert(key),
                Phase::Queued { .. } => queued.insert(key),
                Phase::AwaitingNode { .. } => awaiting.insert(key),
                _ => false,
            };
            if let Some(n) = p.holds_name() {
                let at = n.slot().ok_or_else(|| n.to_string());
                by_node.entry(at).or_default().push(key);
            }
            if e.job.state != p.state() as i32 {
                return Err(format!("{key}: state {} but phase {p:?}", e.job.state));
            }
            if let Some(n) = p.node()
                && e.job.node != n
            {
                return Err(format!("{key}: node {:?} but phase {p:?}", e.job.node));
            }
            if e.job.key() != key {
                return Err(format!("{key}: id {:?}", e.job.id()));
            }
            if self.task_job.get(&e.task) != Some(&key) {
                return Err(format!("{key}: task {:?} maps elsewhere", e.task));
            }
        }
        // The B-tree indexes hold the phases' jobs but those of the
        // short-lived phases, which the logs hold (with stale keys).
        let (mut fresh, mut starting) = (0, 0);
        for (&key, e) in self.table.iter() {
            if is_fresh(&e.phase) {
                fresh += 1;
                unplaced.remove(&key);
            } else if is_starting(&e.phase) {
                starting += 1;
                queued.remove(&key);
            }
        }
        let want = [
            ("awaiting", &awaiting, &self.awaiting),
            ("unplaced", &unplaced, &self.unplaced),
            ("queued", &queued, &self.queued),
        ];
        for (name, truth, index) in want {
            if truth != index {
                return Err(format!("index {name}: {index:?}, the phases say {truth:?}"));
            }
        }
        for (name, count, log, is) in [
            ("fresh", fresh, &self.fresh, is_fresh as fn(&Phase) -> bool),
            ("starting", starting, &self.starting, is_starting),
        ] {
            let listed = log.live_keys(|k, slot| self.in_phase(k, slot, is)).len();
            if log.live != count || listed != count {
                return Err(format!(
                    "log {name}: {} live, {listed} listed, the phases say {count}",
                    log.live
                ));
            }
            if log.keys.len() > 2 * log.live + PhaseLog::SLACK {
                return Err(format!("log {name}: {} keys not compacted", log.keys.len()));
            }
        }
        let listed: BTreeSet<(i64, JobKey)> = self
            .unasked
            .entries
            .iter()
            .copied()
            .filter(|u| self.is_unasked(u))
            .map(|u| u.at())
            .collect();
        if unasked != listed || self.unasked.live != unasked.len() {
            return Err(format!(
                "index unasked: {listed:?} ({} live), the phases say {unasked:?}",
                self.unasked.live
            ));
        }
        if !self.unasked.entries.iter().map(Unasked::at).is_sorted()
            || self.unasked.entries.len() > 2 * self.unasked.live + PhaseLog::SLACK
        {
            return Err(format!(
                "index unasked: {} entries not sorted or not compacted",
                self.unasked.entries.len()
            ));
        }
        if gpus_by_node.len() != self.gpus_by_node.len()
            || gpus_by_node
                .iter()
                .any(|(n, g)| self.gpus_by_node.get(n) != Some(g))
        {
            return Err(format!(
                "index gpus_by_node: {:?}, the phases say {gpus_by_node:?}",
                self.gpus_by_node
            ));
        }
        // The table iterates in key order: each list sorted as built.
        let index: BTreeMap<Result<u32, String>, Vec<JobKey>> = (self.by_node.slots.iter())
            .enumerate()
            .filter(|(_, v)| !v.is_empty())
            .map(|(s, v)| (Ok(s as u32), v.clone()))
            .chain((self.by_node.names.iter()).map(|(n, v)| (Err(n.clone()), v.clone())))
            .collect();
        if index != by_node {
            return Err(format!(
                "index by_node: {:?}, the phases say {by_node:?}",
                self.by_node
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// `Jobs::assign_started` on `fast` and, when it accepts, the general
    /// path's phase change on `slow`: it must accept exactly a job queued
    /// and not waiting on `node`.
    fn assign_started_both(
        fast: &mut Jobs,
        slow: &mut Jobs,
        key: JobKey,
        node: &str,
        t: i64,
    ) -> Result<(), TestCaseError> {
        let via = match slow.get(key).map(|e| e.phase().clone()) {
            Some(Phase::Queued {
                node: n,
                via,
                waiting: false,
            }) if n == node => Some(via),
            _ => None,
        };
        if fast.assign_started(key, &NodeName::from(node), t) {
            let via =
                via.ok_or_else(|| TestCaseError::fail("started in place from another phase"))?;
            slow.set_phase(
                key,
                Phase::Assigned {
                    node: node.into(),
                    since: t,
                    steal_asked: None,
                    via,
                },
            );
        }
        Ok(())
    }

    proptest! {
        /// A reason text kept across a phase change with the same inputs
        /// (`text_inputs`, no requeue since) is the text generating it
        /// again would give: after every step of a random walk over
        /// phases (two nodes, two ways to a node, waiting or not, steals,
        /// requeues in between) and for a plain job and a gang member,
        /// the record's reason equals the previous code's, which
        /// generated it at every change.
        #[test]
        fn kept_reason_texts_equal_the_generated_ones(
            gang in any::<bool>(),
            steps in prop::collection::vec((0u8..7, 0u8..2, 0u8..2, any::<bool>()), 1..40),
        ) {
            let mut jobs = Jobs::new(true);
            let n = jobs.take_number();
            let key = if gang { JobKey::element(n, 1) } else { JobKey::single(n) };
            let job = JobRecord::new(key, Default::default(), Arc::from(""), if gang { 2 } else { 0 }, 0);
            jobs.insert(key, job, Phase::Unplaced { why: Unplaced::New });
            let mut want = jobs.get(key).map(|e| e.job().reason.to_string()).unwrap_or_default();
            for (kind, node, way, flag) in steps {
                let node = ["n1", "n2"][node as usize].to_string();
                let how = Placement {
                    wake: WakeChoice::None,
                    path: [PlacePath::Idlest, PlacePath::Target][way as usize],
                };
                let via = match (kind % 2, flag) {
                    (0, _) => Via::Placed(how),
                    (_, true) => Via::Stolen { from: "n3".into(), level: StealLevel::SameRack },
                    (_, false) => Via::Waited(how),
                };
                let phase = match kind {
                    0 | 1 => Phase::Queued { node: node.into(), via, waiting: flag },
                    2 | 3 => Phase::Assigned { node: node.into(), since: 1, steal_asked: None, via },
                    4 => Phase::Running { node: node.into(), via },
                    5 => Phase::Unplaced { why: Unplaced::Requeued },
                    _ => {
                        jobs.push_requeue(key, Requeue::GivenBack(node));
                        continue;
                    }
                };
                let e = jobs.get(key).unwrap();
                let last = e.requeues.last();
                if let Some(t) = gang_text(&phase, e.job(), last).or_else(|| reason_of(&phase, last)) {
                    want = t;
                }
                jobs.set_phase(key, phase);
                prop_assert_eq!(jobs.get(key).unwrap().job().reason.as_str(), want.as_str());
            }
            jobs.check().map_err(TestCaseError::fail)?;
        }
    }

    proptest! {
        /// The indexes kept by lazy deletion (the phase logs of new and
        /// started jobs, the unasked log) and the per-node sorted key
        /// lists answer what a scan of every job's phase answers: after
        /// every step of random phase changes, steal requests and removals
        /// over many jobs (enough churn for the logs to be compacted),
        /// `unplaced`, `queued`, `oldest_pending`, `unasked_since` and
        /// `on` equal the brute force, and `check` passes.
        #[test]
        fn lazy_indexes_answer_what_the_phases_say(
            steps in prop::collection::vec((0usize..40, 0u8..9, 0u8..3, 0i64..50), 1..400),
        ) {
            let mut jobs = Jobs::new(true);
            let mut keys: Vec<JobKey> = Vec::new();
            for (pick, kind, node, t) in steps {
                // The registry's names carry their slots; "n3" is also
                // named without one (restored from the store, or reported
                // by its agent before it registered), so its jobs are
                // listed under both.
                let slotted = node < 2 || t % 2 == 0;
                let name = NodeName::from(["n1", "n2", "n3"][node as usize]);
                let node = if slotted { name.in_slot(u32::from(node)) } else { name };
                let how = Placement { wake: WakeChoice::None, path: PlacePath::Idlest };
                let key = match keys.get(pick) {
                    Some(&k) if jobs.contains(k) && kind != 0 => k,
                    _ => {
                        let k = JobKey::single(jobs.take_number());
                        let job = JobRecord::new(k, Default::default(), Arc::from(""), 0, 0);
                        jobs.insert(k, job, Phase::Unplaced { why: Unplaced::New });
                        keys.push(k);
                        k
                    }
                };
                match kind {
                    1 => { jobs.set_phase(key, Phase::Queued { node: node.clone(), via: Via::Placed(how), waiting: false }); }
                    2 => { jobs.set_phase(key, Phase::Queued { node: node.clone(), via: Via::Placed(how), waiting: true }); }
                    3 | 4 => { jobs.set_phase(key, Phase::Assigned { node: node.clone(), since: t, steal_asked: None, via: Via::Placed(how) }); }
                    5 => jobs.set_steal_asked(key, (t % 2 == 0).then_some(t)),
                    6 => { jobs.set_phase(key, Phase::Running { node: node.clone(), via: Via::Placed(how) }); }
                    7 => { jobs.set_phase(key, Phase::Unplaced { why: if t % 2 == 0 { Unplaced::Requeued } else { Unplaced::New } }); }
                    8 if t % 3 == 0 => { jobs.remove(key); }
                    _ => { jobs.set_phase(key, Phase::Done { state: JobState::Succeeded, end: End::Reported(String::new()) }); }
                }
                jobs.check().map_err(TestCaseError::fail)?;
                // The brute force: every job's phase.
                let all: Vec<(JobKey, Phase)> = jobs.iter().map(|(k, e)| (k, e.phase().clone())).collect();
                let of = |f: &dyn Fn(&Phase) -> bool| -> Vec<JobKey> {
                    all.iter().filter(|(_, p)| f(p)).map(|(k, _)| *k).collect()
                };
                let unplaced = of(&|p| matches!(p, Phase::Unplaced { .. }));
                let queued = of(&|p| matches!(p, Phase::Queued { .. }));
                prop_assert_eq!(jobs.unplaced(), unplaced.clone());
                prop_assert_eq!(jobs.queued(), queued.clone());
                let mut pending: Vec<JobKey> = unplaced.iter().chain(&queued).copied().collect();
                pending.sort_unstable();
                pending.truncate(5);
                prop_assert_eq!(jobs.oldest_pending(5), pending);
                let unasked = of(&|p| matches!(p, Phase::Assigned { since, steal_asked: None, .. } if *since <= t));
                prop_assert_eq!(jobs.unasked_since(t), unasked);
                for (i, n) in ["n1", "n2", "n3"].into_iter().enumerate() {
                    let slot = NodeSlot::of(&NodeName::from(n).in_slot(i as u32));
                    prop_assert_eq!(jobs.on(n, slot), of(&|p| p.holds() == Some(n)));
                }
            }
        }
    }

    proptest! {
        /// A new job's insert (`insert_new`) and its placement in place
        /// (`queue_new`) leave it as the general path does
        /// (`insert_general`, `set_phase` to the same Queued phase): two
        /// tables take the same random steps (new jobs, some gang members
        /// and some with a GPU, placed on one of three nodes (one name the end of another) with three
        /// ways, to be sent or waiting, with random engine leaves so
        /// that the per-leaf text is hit, missed and stale; requeues,
        /// jobs set back to new, starts and ends); after every step each
        /// job's phase and record are equal, both pass `check`, and their
        /// indexes answer the same.
        #[test]
        fn new_jobs_in_place_are_the_general_path(
            steps in prop::collection::vec((0usize..20, 0u8..7, 0u8..3, 0i64..60, 0usize..4), 1..200),
        ) {
            let (mut fast, mut slow) = (Jobs::new(true), Jobs::new(true));
            let mut keys: Vec<JobKey> = Vec::new();
            let nodes = ["n1", "an1", "n22"];
            for (pick, kind, node, t, leaf) in steps {
                let node = nodes[node as usize].to_string();
                let how = match t % 3 {
                    0 => Placement { wake: WakeChoice::None, path: PlacePath::Idlest },
                    1 => Placement { wake: WakeChoice::Affine, path: PlacePath::Target },
                    _ => Placement { wake: WakeChoice::None, path: PlacePath::Target },
                };
                let key = match keys.get(pick) {
                    Some(&k) if kind != 0 => k,
                    _ => {
                        let n = fast.take_number();
                        slow.take_number();
                        // Every fifth a gang member (its own text: the
                        // general path), every other one with a GPU.
                        let gang = n % 5 == 0;
                        let k = if gang { JobKey::element(n, 0) } else { JobKey::single(n) };
                        let spec = Arc::new(proto::v1::JobSpec { gpus: (t % 2) as u32, ..Default::default() });
                        let job = JobRecord::new(k, spec, Arc::from(""), if gang { 2 } else { 0 }, 0);
                        fast.insert(k, job.clone(), Phase::Unplaced { why: Unplaced::New });
                        slow.insert_general(k, job, Phase::Unplaced { why: Unplaced::New });
                        keys.push(k);
                        k
                    }
                };
                match kind {
                    1 | 2 => {
                        let waiting = t % 4 == 0;
                        if let Err(node) = fast.queue_new(key, node.as_str().into(), how, waiting, leaf) {
                            let fresh = fast.get(key).is_some_and(|e| is_fresh(e.phase()) && !e.job().is_gang());
                            prop_assert!(!fresh, "a new job declined");
                            fast.set_phase(key, Phase::Queued { node, via: Via::Placed(how), waiting });
                        }
                        slow.set_phase(key, Phase::Queued { node: node.as_str().into(), via: Via::Placed(how), waiting });
                    }
                    3 => {
                        for jobs in [&mut fast, &mut slow] {
                            jobs.push_requeue(key, Requeue::GivenBack(node.clone()));
                        }
                    }
                    4 => {
                        for jobs in [&mut fast, &mut slow] {
                            jobs.set_phase(key, Phase::Unplaced { why: Unplaced::New });
                        }
                    }
                    5 => {
                        assign_started_both(&mut fast, &mut slow, key, &node, t)?;
                    }
                    _ => {
                        let done = Phase::Done { state: JobState::Succeeded, end: End::Reported(String::new()) };
                        for jobs in [&mut fast, &mut slow] {
                            jobs.set_phase(key, done.clone());
                        }
                    }
                }
                fast.check().map_err(TestCaseError::fail)?;
                slow.check().map_err(TestCaseError::fail)?;
                for &k in &keys {
                    let (a, b) = (fast.get(k).unwrap(), slow.get(k).unwrap());
                    prop_assert_eq!(a.phase(), b.phase());
                    prop_assert_eq!(a.job(), b.job());
                    prop_assert_eq!(a.task, b.task);
                }
                prop_assert_eq!(fast.take_gpus_freed(), slow.take_gpus_freed());
                prop_assert_eq!(&fast.done_new, &slow.done_new);
                prop_assert_eq!(fast.unplaced(), slow.unplaced());
                prop_assert_eq!(fast.queued(), slow.queued());
                prop_assert_eq!(fast.oldest_pending(50), slow.oldest_pending(50));
                prop_assert_eq!(fast.changes() > 0, slow.changes() > 0);
                for n in nodes {
                    prop_assert_eq!(fast.on(n, None), slow.on(n, None));
                    prop_assert_eq!(fast.gpus_on(n), slow.gpus_on(n));
                }
            }
        }
    }

    proptest! {
        /// `assign_started` leaves a job as `set_phase` to the same
        /// Assigned phase does, and an end in place (`end_in_place`) as
        /// the general path: two tables take the same random steps (jobs
        /// queued to be sent or waiting on one of two nodes, requeues
        /// recorded, steal requests, running, ends with and without a
        /// message), one starting and ending jobs in place, the other
        /// through the general path; after every step
        /// each job's phase and record are equal, both tables pass
        /// `check`, and their indexes answer the same.
        #[test]
        fn assign_started_is_set_phase_in_place(
            steps in prop::collection::vec((0usize..20, 0u8..8, 0u8..2, 0i64..50), 1..200),
        ) {
            let (mut fast, mut slow) = (Jobs::new(true), Jobs::new(true));
            let mut keys: Vec<JobKey> = Vec::new();
            for (pick, kind, node, t) in steps {
                let node = ["n1", "n2"][node as usize].to_string();
                let how = Placement { wake: WakeChoice::None, path: PlacePath::Target };
                let key = match keys.get(pick) {
                    Some(&k) if kind != 0 => k,
                    _ => {
                        let k = JobKey::single(fast.take_number());
                        slow.take_number();
                        // Every other job asks for a GPU (`gpus_by_node`).
                        let spec = Arc::new(proto::v1::JobSpec { gpus: (t % 2) as u32, ..Default::default() });
                        for jobs in [&mut fast, &mut slow] {
                            let job = JobRecord::new(k, spec.clone(), Arc::from(""), 0, 0);
                            jobs.insert(k, job, Phase::Unplaced { why: Unplaced::New });
                        }
                        keys.push(k);
                        k
                    }
                };
                match kind {
                    1 | 2 => {
                        for jobs in [&mut fast, &mut slow] {
                            jobs.set_phase(key, Phase::Queued { node: node.as_str().into(), via: Via::Placed(how), waiting: t % 4 == 0 });
                        }
                    }
                    3 => {
                        for jobs in [&mut fast, &mut slow] {
                            jobs.push_requeue(key, Requeue::GivenBack(node.clone()));
                        }
                    }
                    4 => {
                        assign_started_both(&mut fast, &mut slow, key, &node, t)?;
                    }
                    5 => {
                        for jobs in [&mut fast, &mut slow] {
                            jobs.set_steal_asked(key, (t % 2 == 0).then_some(t));
                        }
                    }
                    6 => {
                        for jobs in [&mut fast, &mut slow] {
                            jobs.set_phase(key, Phase::Running { node: node.as_str().into(), via: Via::Placed(how) });
                        }
                    }
                    _ => {
                        // Ends: in place where `end_in_place` takes them
                        // (no message), the general path on the twin.
                        let end = End::Reported(if t % 5 == 0 { "m".into() } else { String::new() });
                        let done = Phase::Done { state: JobState::Succeeded, end };
                        fast.set_phase(key, done.clone());
                        slow.replace_phase_general(key, done);
                    }
                }
                fast.check().map_err(TestCaseError::fail)?;
                slow.check().map_err(TestCaseError::fail)?;
                for &k in &keys {
                    let (a, b) = (fast.get(k).unwrap(), slow.get(k).unwrap());
                    prop_assert_eq!(a.phase(), b.phase());
                    prop_assert_eq!(a.job(), b.job());
                }
                prop_assert_eq!(fast.unasked_since(t), slow.unasked_since(t));
                prop_assert_eq!(fast.take_gpus_freed(), slow.take_gpus_freed());
                prop_assert_eq!(&fast.done_new, &slow.done_new);
                prop_assert_eq!(fast.queued(), slow.queued());
                for n in ["n1", "n2"] {
                    prop_assert_eq!(fast.on(n, None), slow.on(n, None));
                }
            }
        }
    }

    proptest! {
        /// The phase logs (`fresh`, `starting`) list exactly the jobs
        /// their phases say, whatever slot a job's key was logged with:
        /// a random walk over a few keys, each inserted new (reusing a
        /// key removed before, so in another slot, and a slot another
        /// key left), queued to be sent or waiting, sent, ended, removed;
        /// after every step `unplaced` and `queued` are the brute-force
        /// answers over the table and `check` passes (it fails when the
        /// slot is read without comparing the key it holds).
        #[test]
        fn phase_logs_list_what_the_table_says(
            steps in prop::collection::vec((0usize..6, 0u8..6), 1..300),
        ) {
            let mut jobs = Jobs::new(true);
            let keys: Vec<JobKey> = (1..=6).map(JobKey::single).collect();
            let how = Placement { wake: WakeChoice::None, path: PlacePath::Target };
            for (pick, kind) in steps {
                let key = keys[pick];
                let present = jobs.get(key).is_some();
                match kind {
                    0 | 1 if !present => {
                        let job = JobRecord::new(key, Default::default(), Arc::from(""), 0, 0);
                        jobs.insert(key, job, Phase::Unplaced { why: Unplaced::New });
                    }
                    0 => {
                        jobs.remove(key);
                    }
                    1 | 2 => {
                        let _ = jobs.queue_new(key, "n1".into(), how, kind == 2, 0);
                    }
                    3 if present => {
                        jobs.set_phase(key, Phase::Queued { node: "n1".into(), via: Via::Placed(how), waiting: false });
                    }
                    4 if present => {
                        jobs.set_phase(key, Phase::Assigned { node: "n1".into(), since: 1, steal_asked: None, via: Via::Placed(how) });
                    }
                    5 if present => {
                        jobs.set_phase(key, Phase::Unplaced { why: Unplaced::New });
                    }
                    _ => {}
                }
                jobs.check().map_err(TestCaseError::fail)?;
                let of = |f: fn(&Phase) -> bool| -> Vec<JobKey> {
                    jobs.iter().filter(|(_, e)| f(e.phase())).map(|(k, _)| k).collect()
                };
                prop_assert_eq!(jobs.unplaced(), of(|p| matches!(p, Phase::Unplaced { .. })));
                prop_assert_eq!(jobs.queued(), of(|p| matches!(p, Phase::Queued { .. })));
            }
        }
    }

    /// The agent-level steal's candidates: ASSIGNED jobs sent long
    /// enough ago and not asked back yet, in key order; asking one back
    /// takes it out, clearing the request puts it back, and the index
    /// agrees with the brute-force recomputation of `check` throughout.
    #[test]
    fn unasked_index_follows_sends_and_requests() {
        let mut jobs = Jobs::new(true);
        let assigned = |since| Phase::Assigned {
            node: "n1".into(),
            since,
            steal_asked: None,
            via: Via::Restored,
        };
        let keys: Vec<JobKey> = (0..3).map(|_| JobKey::single(jobs.take_number())).collect();
        for (i, &key) in keys.iter().enumerate() {
            let job = JobRecord::new(key, Default::default(), Arc::from(""), 0, 0);
            jobs.insert(key, job, Phase::Unplaced { why: Unplaced::New });
            // Sent at 30, 20, 10: the index is by time, the answer by key.
            jobs.set_phase(key, assigned(30 - 10 * i as i64));
        }
        assert_eq!(jobs.unasked_since(20), vec![keys[1], keys[2]]);
        jobs.set_steal_asked(keys[1], Some(40));
        assert_eq!(jobs.unasked_since(100), vec![keys[0], keys[2]]);
        jobs.check().unwrap();
        jobs.set_steal_asked(keys[1], None);
        assert_eq!(jobs.unasked_since(100), keys);
        jobs.set_phase(
            keys[0],
            Phase::Unplaced {
                why: Unplaced::Requeued,
            },
        );
        assert_eq!(jobs.unasked_since(100), vec![keys[1], keys[2]]);
        jobs.check().unwrap();
    }

    /// A removed job leaves the table and every index (checked against
    /// the brute force), and the listing keeps its order around the hole.
    #[test]
    fn removed_jobs_leave_every_index() {
        let mut jobs = Jobs::new(true);
        let keys: Vec<JobKey> = (0..4).map(|_| JobKey::single(jobs.take_number())).collect();
        for &key in &keys {
            let job = JobRecord::new(key, Default::default(), Arc::from(""), 0, 0);
            jobs.insert(key, job, Phase::Unplaced { why: Unplaced::New });
        }
        let running = Phase::Running {
            node: "n1".into(),
            via: Via::Restored,
        };
        jobs.set_phase(keys[1], running.clone());
        jobs.set_phase(keys[2], running);
        let task = jobs.get(keys[1]).map(|e| e.task).unwrap();
        assert!(jobs.remove(keys[1]).is_some());
        assert!(jobs.remove(keys[1]).is_none());
        jobs.remove(keys[0]);
        jobs.check().unwrap();
        assert_eq!(jobs.of_task(task), None);
        assert_eq!(jobs.on("n1", None), vec![keys[2]]);
        assert_eq!(jobs.unplaced(), vec![keys[3]]);
        let order: Vec<JobKey> = jobs.iter().rev().map(|(k, _)| k).collect();
        assert_eq!(order, vec![keys[3], keys[2]]);
        // A new job takes a freed slot and still lists in key order.
        let key = JobKey::single(jobs.take_number());
        let job = JobRecord::new(key, Default::default(), Arc::from(""), 0, 0);
        jobs.insert(key, job, Phase::Unplaced { why: Unplaced::New });
        let order: Vec<JobKey> = jobs.below(key).map(|(k, _)| k).collect();
        assert_eq!(order, vec![keys[3], keys[2]]);
        assert_eq!(jobs.len(), 3);
        jobs.check().unwrap();
    }

    /// Jobs that wait for the same selector share one copy of it and of
    /// their reason text (an array's elements, each placed and refused in
    /// turn); another selector gets its own; the texts are the
    /// selectors'.
    #[test]
    fn no_match_selectors_are_shared() {
        let mut jobs = Jobs::new(true);
        let no_match = |label: &str| Phase::Unplaced {
            why: Unplaced::NoMatch {
                selector: Arc::new(BTreeMap::from([("gpu".to_string(), label.to_string())])),
                cpus: 1,
                align: Align::Any,
                memory_bytes: 0,
                gpus: 0,
            },
        };
        let keys: Vec<JobKey> = (0..3).map(|i| JobKey::element(1, i)).collect();
        for (i, &key) in keys.iter().enumerate() {
            let job = JobRecord::new(key, Default::default(), Arc::from(""), 0, 0);
            jobs.insert(key, job, Phase::Unplaced { why: Unplaced::New });
            jobs.set_phase(key, no_match(if i == 2 { "a100" } else { "h100" }));
        }
        let selector = |k| match jobs.get(k).map(JobEntry::phase) {
            Some(Phase::Unplaced {
                why: Unplaced::NoMatch { selector, .. },
            }) => selector.clone(),
            p => panic!("{p:?}"),
        };
        assert!(Arc::ptr_eq(&selector(keys[0]), &selector(keys[1])));
        assert!(!Arc::ptr_eq(&selector(keys[1]), &selector(keys[2])));
        assert_eq!(
            selector(keys[2]).get("gpu").map(String::as_str),
            Some("a100")
        );
        let reason = |k| jobs.get(k).map(|e| e.job().reason.clone()).unwrap();
        assert_eq!(
            reason(keys[1]),
            "no node matches selector {\"gpu\": \"h100\"}, 1 CPUs aligned to any"
        );
        // The texts too: one copy for the two that show the same.
        assert!(reason(keys[0]).is_shared_with(&reason(keys[1])));
        assert!(!reason(keys[1]).is_shared_with(&reason(keys[2])));
        jobs.check().unwrap();
    }

    /// The retention's queue: jobs restored terminal go by their end
    /// times (not their load order), a job with no end time by when it is
    /// first seen terminal, the cap drops the first ended, and a gang
    /// member waits for its gang's last member to end.
    #[test]
    fn expired_jobs_go_by_end_time_and_gangs_whole() {
        let mut jobs = Jobs::new(true);
        let done = || Phase::Done {
            state: JobState::Succeeded,
            end: End::Reported(String::new()),
        };
        // Restored in key order, ended 300, 100, 200.
        for (n, end) in [(1, 300), (2, 100), (3, 200)] {
            let key = JobKey::single(n);
            let mut job = JobRecord::new(key, Default::default(), Arc::from(""), 0, 0);
            job.end_time_ms = end;
            jobs.insert(key, job, done());
        }
        let single = JobKey::single;
        assert_eq!(jobs.expired(1_000, 10_000, 2), vec![single(2)]);
        assert_eq!(jobs.expired(10_250, 10_000, 2), vec![single(3)]);
        assert!(jobs.expired(10_250, 10_000, 2).is_empty());
        for k in [single(2), single(3)] {
            jobs.remove(k);
        }
        // A gang of two: member 0 ends first, member 1 still runs.
        let (m0, m1) = (JobKey::element(9, 0), JobKey::element(9, 1));
        for k in [m0, m1] {
            let job = JobRecord::new(k, Default::default(), Arc::from(""), 2, 0);
            jobs.insert(k, job, Phase::Unplaced { why: Unplaced::New });
        }
        jobs.set_phase(m0, done());
        jobs.set_phase(
            m1,
            Phase::Running {
                node: "n1".into(),
                via: Via::Restored,
            },
        );
        assert_eq!(jobs.expired(20_000, 10_000, 10), vec![single(1)]);
        jobs.remove(single(1));
        assert!(jobs.expired(40_000, 10_000, 10).is_empty(), "its gang runs");
        jobs.set_phase(m1, done());
        // Member 0 was looked at again at 40,000; member 1 has no end
        // time: first seen terminal at 50,000.
        assert_eq!(jobs.expired(50_000, 10_000, 10), vec![m0]);
        jobs.remove(m0);
        assert!(jobs.expired(59_999, 10_000, 10).is_empty());
        assert_eq!(jobs.expired(60_000, 10_000, 10), vec![m1]);
        jobs.check().unwrap();
    }

    /// The texts as they were built before they were written into one
    /// buffer (a `Vec` of parts joined, then formatted): the oracle.
    fn placement_oracle(how: Placement) -> String {
        let mut parts = Vec::new();
        if how.path == PlacePath::Pack {
            parts.push("pack: lowest-numbered node with room");
        }
        match how.wake {
            WakeChoice::Wide => parts.push("wake_wide: the waker fans out, spread"),
            WakeChoice::Affine => parts.push("wake_affine: near the waker"),
            WakeChoice::None | WakeChoice::Prev => {}
        }
        match how.path {
            PlacePath::BusySkip => parts.push("busy-skip: cluster full, no scan"),
            PlacePath::IdlestBusySkip => {
                parts.push("busy-skip: cluster full, no scan");
                parts.push("find_idlest: emptiest zone, rack and node");
            }
            PlacePath::Target => parts.push("select_idle_sibling: target had room"),
            PlacePath::IdleCore => parts.push("select_idle_sibling: idle host group in the rack"),
            PlacePath::IdleLeaf => parts.push("select_idle_sibling: idle node in the rack"),
            PlacePath::Idlest => parts.push("find_idlest: emptiest zone, rack and node"),
            PlacePath::Pack | PlacePath::NoneIdle => {}
        }
        if parts.is_empty() {
            parts.push("placed");
        }
        parts.join("; ")
    }

    fn via_oracle(via: &Via, node: &str, last: Option<&Requeue>) -> Option<String> {
        let with_history = |s: String| match last {
            Some(r) => format!("{r} | {s}"),
            None => s,
        };
        let queued = |how, node: &str| {
            format!(
                "queued on {node} ({}): no node has room",
                placement_oracle(how)
            )
        };
        match via {
            Via::Placed(how) => Some(with_history(format!(
                "{} -> {node}",
                placement_oracle(*how)
            ))),
            Via::Waited(how) => Some(format!(
                "started on {node} when it had room; was {}",
                with_history(queued(*how, node))
            )),
            Via::Stolen { from, level } => Some(format!(
                "steal: {node} took it from overloaded {from} ({})",
                level.name()
            )),
            Via::Restored => None,
        }
    }

    /// Every placement, every way a job comes to its node, with and
    /// without a requeue history: the reason texts equal the oracle's.
    #[test]
    fn reason_texts_match_the_previous_formatting() {
        use PlacePath as P;
        use WakeChoice as W;
        let paths = [
            P::Pack,
            P::Target,
            P::IdleCore,
            P::IdleLeaf,
            P::NoneIdle,
            P::BusySkip,
            P::Idlest,
            P::IdlestBusySkip,
        ];
        let wakes = [W::None, W::Wide, W::Affine, W::Prev];
        let retry = Requeue::Retry {
            n: 1,
            of: 2,
            node: "b".into(),
            why: "missed heartbeats",
        };
        let mut seen = 0;
        for path in paths {
            for wake in wakes {
                let how = Placement { wake, path };
                assert_eq!(placement_text(how), placement_oracle(how));
                let stolen = Via::Stolen {
                    from: "c".into(),
                    level: StealLevel::SameZone,
                };
                for via in [Via::Placed(how), Via::Waited(how), stolen, Via::Restored] {
                    for last in [None, Some(&retry)] {
                        assert_eq!(via_text(&via, "n7", last), via_oracle(&via, "n7", last));
                        let queued = Phase::Queued {
                            node: "n7".into(),
                            via: Via::Placed(how),
                            waiting: true,
                        };
                        let want = match last {
                            Some(r) => format!(
                                "{r} | queued on n7 ({}): no node has room",
                                placement_oracle(how)
                            ),
                            None => format!(
                                "queued on n7 ({}): no node has room",
                                placement_oracle(how)
                            ),
                        };
                        assert_eq!(reason_of(&queued, last), Some(want));
                        seen += 1;
                    }
                }
            }
        }
        assert_eq!(seen, 8 * 4 * 4 * 2);
    }

    /// The texts `reason_into` copies or writes itself rather than
    /// formatting through `Display`, against the texts as written before.
    #[test]
    fn constant_reason_texts_match_the_previous_formatting() {
        let retry = Requeue::Retry {
            n: 1,
            of: 2,
            node: "b".into(),
            why: "missed heartbeats",
        };
        let unplaced = |why| Phase::Unplaced { why };
        let cases = [
            (unplaced(Unplaced::New), None, Some("submitted")),
            (
                unplaced(Unplaced::NoNodes),
                None,
                Some("no nodes registered yet"),
            ),
            (unplaced(Unplaced::Requeued), None, Some("requeued")),
            (
                unplaced(Unplaced::Requeued),
                Some(&retry),
                Some("retry 1 of 2: node b lost (missed heartbeats)"),
            ),
            (unplaced(Unplaced::Restored), None, None),
            (
                unplaced(Unplaced::GpusBusy { gpus: 2 }),
                None,
                Some("waiting for 2 free GPUs on one node"),
            ),
            (
                Phase::Done {
                    state: JobState::Cancelled,
                    end: End::CancelledPending,
                },
                None,
                Some("cancelled by user while pending"),
            ),
            (
                Phase::Done {
                    state: JobState::Succeeded,
                    end: End::Reported(String::new()),
                },
                None,
                None,
            ),
            (
                Phase::Done {
                    state: JobState::Failed,
                    end: End::Reported("exit 3".into()),
                },
                None,
                Some("exit 3"),
            ),
        ];
        for (phase, last, want) in cases {
            assert_eq!(reason_of(&phase, last).as_deref(), want, "{phase:?}");
        }
        // One buffer for several texts: each is written after a clear.
        let mut jobs = Jobs::new(false);
        let key = JobKey::single(jobs.take_number());
        let job = JobRecord::new(key, Default::default(), Arc::from(""), 0, 0);
        jobs.insert(key, job, unplaced(Unplaced::New));
        assert_eq!(jobs.get(key).unwrap().job().reason.as_str(), "submitted");
        jobs.set_phase(key, unplaced(Unplaced::NoNodes));
        assert_eq!(
            jobs.get(key).unwrap().job().reason.as_str(),
            "no nodes registered yet"
        );
        jobs.set_phase(key, unplaced(Unplaced::Requeued));
        assert_eq!(jobs.get(key).unwrap().job().reason.as_str(), "requeued");
    }
}
