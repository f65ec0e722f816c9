//! Tasks: the schedulable entities (a job's process or 1-CPU share in the
//! agent; a job in the dispatcher) and their per-task scheduler state, the
//! fields of the kernel's `task_struct`/`sched_entity` that the seeds use.

use std::sync::Arc;

use crate::alloc::Align;
use crate::config::Policy;
use crate::topology::LeafId;

/// The caller's id of a task; the engine never invents ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TaskId(pub u64);

/// A set of leaves a task may run on (`cpus_allowed`; cluster: the nodes
/// matching a job's node selector).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeafSet {
    words: Vec<u64>,
}

impl LeafSet {
    /// The empty set over `nr_leaves` leaves.
    pub fn new(nr_leaves: usize) -> Self {
        Self {
            words: vec![0; nr_leaves.div_ceil(64)],
        }
    }

    /// A set holding `leaves`.
    pub fn from_leaves(nr_leaves: usize, leaves: impl IntoIterator<Item = LeafId>) -> Self {
        let mut s = Self::new(nr_leaves);
        for l in leaves {
            s.insert(l);
        }
        s
    }

    /// Add a leaf (ignored when out of range).
    pub fn insert(&mut self, leaf: LeafId) {
        if let Some(w) = self.words.get_mut(leaf / 64) {
            *w |= 1 << (leaf % 64);
        }
    }

    /// True when the set holds `leaf`.
    pub fn contains(&self, leaf: LeafId) -> bool {
        self.words
            .get(leaf / 64)
            .is_some_and(|w| w & (1 << (leaf % 64)) != 0)
    }

    /// True when the set is empty.
    pub fn is_empty(&self) -> bool {
        self.words.iter().all(|&w| w == 0)
    }

    /// The leaves in the set, ascending.
    pub fn iter(&self) -> impl Iterator<Item = LeafId> + '_ {
        self.words.iter().enumerate().flat_map(|(i, &w)| {
            (0..64)
                .filter(move |b| w & (1 << b) != 0)
                .map(move |b| i * 64 + b)
        })
    }
}

/// What the caller says about a new task.
#[derive(Clone, Debug)]
pub struct TaskSpec {
    /// The caller's id.
    pub id: TaskId,
    /// Nice, -20..=19: the weight.
    pub nice: i32,
    /// Latency-nice, -20..=19: negative enters the latency timeline.
    pub latency_nice: i32,
    /// Capacity units the task occupies while running (1 for a CPU task,
    /// the job's CPUs in the dispatcher).
    pub demand: u32,
    /// Leaves the task may run on; `None` = all.
    pub affinity: Option<Arc<LeafSet>>,
    /// Placement policy; `None` = the engine's default.
    pub policy: Option<Policy>,
    /// Where the task's capacity units must be inside a leaf that is a
    /// machine (a job's CPUs on one LLC, ...); `Any` for CPU tasks.
    pub align: Align,
    /// The most execution time the task will use, ns (the dispatcher fills
    /// it from the job's `timeout`); `None` = unknown. EASY backfill
    /// computes a blocked head's reservation from the running tasks'
    /// limits: a running task is expected to end at
    /// `now + time_limit - executed`, one without a limit never.
    pub time_limit: Option<u64>,
    /// A predicted run time, ns (the dispatcher's per-user history of
    /// run times, EASY++); `None` = none. Where it is shorter than the
    /// limit (or there is no limit) the reservation and backfill count on
    /// it instead, while it holds (see [`Task::estimate`] and
    /// `Sched::reservation`).
    pub predicted: Option<u64>,
}

impl TaskSpec {
    /// A nice-0, latency-nice-0, demand-1 task allowed everywhere.
    pub fn new(id: TaskId) -> Self {
        Self {
            id,
            nice: 0,
            latency_nice: 0,
            demand: 1,
            affinity: None,
            policy: None,
            align: Align::Any,
            time_limit: None,
            predicted: None,
        }
    }
}

/// Where a task is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TaskState {
    /// Not runnable (blocked, or never woken).
    Sleeping,
    /// Runnable and waiting in a leaf's run queue.
    Queued(LeafId),
    /// Running on a leaf.
    Running(LeafId),
}

/// A task and its scheduler state.
#[derive(Clone, Debug)]
pub struct Task {
    /// The caller's id.
    pub id: TaskId,
    /// Nice value.
    pub nice: i32,
    /// Load weight from nice.
    pub weight: u64,
    /// Latency-nice value.
    pub latency_nice: i32,
    /// `sched_latency * latency_nice / 40`.
    pub latency_offset: i64,
    /// Capacity units while running.
    pub demand: u32,
    /// Allowed leaves (`None` = all).
    pub affinity: Option<Arc<LeafSet>>,
    /// Placement policy.
    pub policy: Policy,
    /// Alignment inside a machine leaf.
    pub align: Align,
    /// Execution time limit, ns (`None` = unknown).
    pub time_limit: Option<u64>,
    /// Predicted run time, ns (`None` = none; 0 is taken as none).
    pub predicted: Option<u64>,
    /// Where the task is.
    pub state: TaskState,
    /// Virtual runtime, ns of nice-0 time.
    pub vruntime: i64,
    /// Total execution time, ns.
    pub sum_exec_runtime: u64,
    /// `sum_exec_runtime` when the task last started running.
    pub prev_sum_exec_runtime: u64,
    /// Clock when execution was last accounted.
    pub exec_start: u64,
    /// The leaf it last ran or queued on (`task_cpu`).
    pub prev_leaf: Option<LeafId>,
    /// A leaf it recently used (`recent_used_cpu`).
    pub recent_used_leaf: Option<LeafId>,
    /// The task this one last woke (seed 001 `last_wakee`).
    pub last_wakee: Option<TaskId>,
    /// Times it switched wakee since the last decay (`wakee_flips`,
    /// `nr_wakee_switch` in seed 001).
    pub wakee_flips: u32,
    /// Clock of the last once-a-second wipe of `wakee_flips`.
    pub wakee_flip_decay_ts: u64,
    /// When the task last became runnable and waiting (woken, or put
    /// back by preemption), kept across migrations: the start of its
    /// current run delay (the kernel's `sched_info.last_queued`).
    pub queued_at: u64,
    /// Queued in the latency timeline too.
    pub(crate) in_latency_tree: bool,
    /// Woken since it last ran (used for the latency timeline's rule).
    pub(crate) enqueue_seq: u64,
}

impl Task {
    pub(crate) fn new(spec: TaskSpec, default_policy: Policy, sched_latency: u64) -> Self {
        Self {
            id: spec.id,
            nice: spec.nice,
            weight: crate::weight::nice_to_weight(spec.nice),
            latency_nice: spec.latency_nice,
            latency_offset: crate::weight::calc_latency_offset(sched_latency, spec.latency_nice),
            demand: spec.demand,
            affinity: spec.affinity,
            policy: spec.policy.unwrap_or(default_policy),
            align: spec.align,
            time_limit: spec.time_limit,
            predicted: spec.predicted.filter(|&p| p > 0),
            state: TaskState::Sleeping,
            vruntime: 0,
            sum_exec_runtime: 0,
            prev_sum_exec_runtime: 0,
            exec_start: 0,
            prev_leaf: None,
            recent_used_leaf: None,
            last_wakee: None,
            wakee_flips: 0,
            wakee_flip_decay_ts: 0,
            queued_at: 0,
            in_latency_tree: false,
            enqueue_seq: 0,
        }
    }

    /// Execution time used up to `now` (`sum_exec_runtime` plus the part of
    /// the current run not yet accounted).
    pub fn executed(&self, now: u64) -> u64 {
        match self.state {
            TaskState::Running(_) => self.sum_exec_runtime + now.saturating_sub(self.exec_start),
            _ => self.sum_exec_runtime,
        }
    }

    /// When the task is expected to end if it runs from `now` on: `now`
    /// plus what its time limit leaves (at least `now`: an overrun task is
    /// expected to end at once); `None` without a limit.
    pub fn expected_end(&self, now: u64) -> Option<u64> {
        self.expected_end_accounted(now, now, false)
    }

    /// [`Task::expected_end`] with its execution accounted up to
    /// `accounted` when that is later than `now` (a tick at that time whose
    /// accounting is deferred, `Sched::tick`, has counted the run up to
    /// it), and with its run-time prediction in force when `predicted`
    /// ([`Task::estimate`]).
    pub(crate) fn expected_end_accounted(
        &self,
        now: u64,
        accounted: u64,
        predicted: bool,
    ) -> Option<u64> {
        let executed = self.executed(now.max(accounted));
        self.estimate(executed, predicted)
            .map(|total| now.saturating_add(total.saturating_sub(executed)))
    }

    /// It has a time limit or a run-time prediction: some
    /// [`Task::estimate`] may be `Some` (with predictions counted on, or
    /// with a limit, always).
    pub fn is_bounded(&self) -> bool {
        self.time_limit.is_some() || self.predicted.is_some()
    }

    /// The run time the task is expected to use in all once it has run
    /// `executed`: its time limit; with `predicted`, its prediction in
    /// force when that is shorter (or there is no limit). The prediction
    /// in force is the prediction doubled as often as `executed` has
    /// passed it (`p`, then `2p`, `4p`, ...): a task that outlives its
    /// prediction is expected to run as long again as the prediction it
    /// passed, so an estimate is never more than twice the run it
    /// estimates, and a task running `r` passes at most
    /// `log2(r / p)` predictions. `None` without a limit or a prediction.
    pub fn estimate(&self, executed: u64, predicted: bool) -> Option<u64> {
        let pred = self
            .predicted
            .filter(|_| predicted)
            .map(|p| prediction_in_force(p, executed));
        match (self.time_limit, pred) {
            (Some(l), Some(p)) => Some(l.min(p)),
            (l, None) => l,
            (None, p) => p,
        }
    }

    /// When, running, the task last passed a prediction that governed its
    /// estimate (one shorter than its limit: past the limit, the limit
    /// governs), evaluated at clock `at`:
    /// `None` while it has passed none. The engine stops counting on
    /// predictions for a head that waits on a leaf where this happened
    /// since it began to wait (`Sched::reservation`).
    pub fn prediction_missed_at(&self, at: u64) -> Option<u64> {
        let p = self.predicted?;
        let executed = self.executed(at);
        // Passing a prediction as long as the limit is no miss: the limit
        // was the estimate, a real bound.
        let cap = self.time_limit.unwrap_or(u64::MAX);
        if executed <= p || p >= cap {
            return None;
        }
        // The largest p * 2^k below both: the last prediction passed that
        // governed the estimate.
        let mut passed = p;
        while let Some(next) = passed.checked_mul(2)
            && next < executed
            && next < cap
        {
            passed = next;
        }
        Some(at.saturating_sub(executed - passed))
    }

    /// True when the task is in the latency class (negative latency
    /// offset) and latency-nice is `enabled`.
    pub fn latency_class(&self, enabled: bool) -> bool {
        enabled && self.latency_offset < 0
    }

    /// True when the task may run on `leaf`.
    pub fn allowed(&self, leaf: LeafId) -> bool {
        self.affinity.as_ref().is_none_or(|a| a.contains(leaf))
    }
}

/// The prediction `p` doubled until it is at least `executed` (`p` itself
/// while `executed <= p`: a task that reaches its prediction is expected
/// to end then, as one that reaches its limit; saturates at `u64::MAX`).
pub(crate) fn prediction_in_force(p: u64, executed: u64) -> u64 {
    let mut x = p.max(1);
    while x < executed {
        match x.checked_mul(2) {
            Some(n) => x = n,
            None => return u64::MAX,
        }
    }
    x
}
