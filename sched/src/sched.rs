//! The engine: [`Sched`] owns the run queues, tasks, overload masks, busy
//! flags, packing index and schedstats of one topology, and implements the
//! fair class around them: enqueue/dequeue, `pick_next_entity` with the
//! latency timeline, time slices on the tick, wakeup preemption, and the
//! transitions that keep the masks and flags exact.
//!
//! With [`SchedConfig::backfill`] a head that cannot start does not block
//! its queue: EASY backfill (Slurm's, not the kernel's: a CPU never has
//! to wait for room) gives the head a [`Reservation`] from the running
//! tasks' time limits and starts later tasks that cannot delay it.
//!
//! The tick accounts lazily: a leaf's tick only records its time, and the
//! accounting it would have done (`update_curr` of the running tasks,
//! `update_min_vruntime`) runs when the leaf next changes; reads compute
//! the accounted values ([`Sched::tick`]). Every value read and every
//! decision is the eager tick's.
//!
//! Placement (`select_task_rq`) lives in `select`, stealing in `steal`;
//! both are `impl Sched` blocks over the state kept here. The engine is
//! synchronous and reads no clock: every call takes `now` in nanoseconds
//! of the caller's clock (real in the agent and dispatcher, simulated in
//! the harness). What changed for the outside world (a task started,
//! stopped or moved) is reported as [`SchedEvent`]s.

use std::borrow::Cow;
use std::sync::Arc;

use thiserror::Error;

use crate::alloc::{Align, FreeSummary};
use crate::busy::{BusyFlags, NohzMask};
use crate::config::{NodeLimitScope, SchedConfig};
use crate::idhash::IdMap;
use crate::idlest::IdlestIndex;
use crate::overload::{LlcDemands, OverloadMasks};
use crate::pack::PackIndex;
use crate::reserve::DomainHeads;
use crate::rq::{OptTime, RunQueue};
use crate::select::Placement;
use crate::stats::Schedstats;
use crate::task::{LeafSet, Task, TaskId, TaskSpec, TaskState};
use crate::topology::{LeafId, NodeId, Topology};
use crate::weight::{NICE_0_LOAD, calc_delta_fair, nice_in_range};

/// Errors of engine calls. Inputs that come from outside the process are
/// validated into these, never panics.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum SchedError {
    /// No task with this id.
    #[error("unknown task {0:?}")]
    UnknownTask(TaskId),
    /// A task with this id already exists.
    #[error("task {0:?} already exists")]
    DuplicateTask(TaskId),
    /// A leaf index out of range.
    #[error("leaf {leaf} out of range (topology has {nr_leaves} leaves)")]
    BadLeaf {
        /// The leaf given.
        leaf: LeafId,
        /// Number of leaves.
        nr_leaves: usize,
    },
    /// nice or latency_nice outside -20..=19.
    #[error("{field} = {value} is outside -20..=19")]
    BadNice {
        /// Which field.
        field: &'static str,
        /// The value given.
        value: i32,
    },
    /// A task must occupy at least one capacity unit.
    #[error("demand must be at least 1")]
    ZeroDemand,
    /// The task's affinity allows no leaf of this topology.
    #[error("task {0:?} is allowed on no leaf")]
    EmptyAffinity(TaskId),
    /// The operation needs a sleeping task.
    #[error("task {0:?} is already runnable")]
    AlreadyRunnable(TaskId),
    /// The leaf is not in the task's affinity.
    #[error("task {task:?} may not run on leaf {leaf}")]
    NotAllowed {
        /// The task.
        task: TaskId,
        /// The leaf.
        leaf: LeafId,
    },
}

/// What changed for the outside world. The agent turns these into
/// SIGCONT/SIGSTOP and affinity changes; the dispatcher into assignments.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SchedEvent {
    /// The task started running on the leaf.
    Started {
        /// The task.
        task: TaskId,
        /// The leaf.
        leaf: LeafId,
    },
    /// The task stopped running but stays runnable on the leaf.
    Preempted {
        /// The task.
        task: TaskId,
        /// The leaf.
        leaf: LeafId,
    },
    /// A waiting task moved between leaves (stolen).
    Migrated {
        /// The task.
        task: TaskId,
        /// Where it waited.
        from: LeafId,
        /// Where it runs or waits now.
        to: LeafId,
    },
}

/// Aggregates of a tree node's leaves, kept exact on every change so that
/// cluster-scale descents cost O(depth x fanout), not O(leaves).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeAgg {
    /// Sum of capacities.
    pub capacity: u64,
    /// Sum of runnable demand.
    pub nr_running: u64,
    /// Sum of `fit_free` (room for newcomers).
    pub sum_free: u64,
    /// Largest `fit_free` of one leaf.
    pub max_free: u32,
    /// Largest room of one leaf per alignment level (indexed by
    /// [`Align::index`]).
    pub max_room: [u32; 5],
}

/// A leaf's [`NodeAgg`] in 32 bytes where a `NodeAgg` takes 48 (a
/// cluster's engine has one per node): a leaf's own capacity, demand and
/// room fit `u32`, and its `sum_free` is its `max_free`, its `fit_free`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct LeafAgg {
    capacity: u32,
    nr_running: u32,
    free: u32,
    max_room: [u32; 5],
}

impl From<LeafAgg> for NodeAgg {
    #[inline]
    fn from(a: LeafAgg) -> Self {
        Self {
            capacity: a.capacity as u64,
            nr_running: a.nr_running as u64,
            sum_free: a.free as u64,
            max_free: a.free,
            max_room: a.max_room,
        }
    }
}

/// The reservation of a leaf's head under EASY backfill: when the head
/// can start at the latest, from the running tasks' time limits, and the
/// capacity that will be left over then.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reservation {
    /// The head: the first waiting task, in next-to-run order, that fits
    /// the leaf's capacity at all.
    pub task: TaskId,
    /// Its shadow time: the earliest time at which enough running tasks
    /// will have ended for its demand, `now` if the capacity is free now
    /// (blocked by alignment only), `None` if that needs a running task
    /// without a time limit (or, with `predicted`, a prediction) to end.
    pub start: Option<u64>,
    /// Capacity free at `start` beyond the head's demand ("extra nodes"):
    /// a task may use it now however long it runs.
    pub extra: u32,
    /// `start` counts on run-time predictions ([`crate::TaskSpec::predicted`]),
    /// and a task may be backfilled on its prediction: no prediction on
    /// the leaf has failed since the head began to wait.
    pub predicted: bool,
}

/// The scheduling engine over one topology.
#[derive(Debug)]
pub struct Sched {
    pub(crate) topo: Arc<Topology>,
    pub(crate) config: SchedConfig,
    pub(crate) rqs: Vec<RunQueue>,
    pub(crate) tasks: IdMap<TaskId, Task>,
    pub(crate) overload: OverloadMasks,
    pub(crate) busy: BusyFlags,
    /// The leaves whose tick runs (not empty-and-idle), kept by
    /// `refresh_leaf`: [`Sched::tick_all`] visits only these.
    nohz: NohzMask,
    /// Per leaf, its aggregate in 32 bytes ([`LeafAgg`]); per domain
    /// (node `nr_leaves + i` at `i`), its [`NodeAgg`]: read either
    /// through [`Sched::agg`].
    leaf_agg: Vec<LeafAgg>,
    dom_agg: Vec<NodeAgg>,
    pub(crate) pack: PackIndex,
    /// Per domain, an index over its children's aggregates: their maxima
    /// (the domain's `max_room`, `max_free`) and the child `find_idlest`
    /// picks.
    pub(crate) idlest: IdlestIndex,
    pub(crate) stats: Schedstats,
    pub(crate) events: Vec<SchedEvent>,
    seq: u64,
    /// Stealing within an LLC passes node-limit gating.
    pub(crate) steal_llc_allowed: bool,
    /// Per LLC: stealing from its sibling LLCs passes node-limit gating.
    pub(crate) steal_cross_allowed: Vec<bool>,
    /// The latest `now` a call passed in (to recompute reservations when
    /// the configuration changes between calls).
    last_now: u64,
    /// Tasks waiting on all leaves (the sum of the `tasks_timeline`
    /// lengths): with none and no leaf overloaded, `schedule` has nothing
    /// to start or pull ([`Sched::schedule_one`]).
    nr_waiting: usize,
    /// One reservation per steal domain (`SchedConfig::domain_reservation`).
    pub(crate) domains: DomainHeads,
    /// Per LLC, the demands of its waiting tasks (the steal search's
    /// skip test).
    pub(crate) llc_demands: LlcDemands,
    /// Steal searches skip sources that cannot supply a fitting task (on
    /// unless a test turns it off to compare with the full walk).
    pub(crate) steal_skip: bool,
    /// Per leaf, the time of its latest tick whose accounting is deferred
    /// (the lazy tick, [`Sched::tick`]); `None` when there is none.
    tick_pending: Vec<OptTime>,
    /// Per leaf, its running tasks whose weight is not nice-0: their
    /// vruntime rounds at every accounting, so their leaf ticks eagerly.
    nr_reweighted: Vec<u32>,
    /// Per leaf, the latest time a task that ran there passed a run-time
    /// prediction that governed its estimate
    /// ([`Task::prediction_missed_at`]), recorded when it stopped running
    /// (while it runs, the reservation reads it from the task).
    pred_missed: Vec<OptTime>,
    /// Ticks defer their accounting (on unless a test compares with the
    /// eager tick).
    lazy_tick: bool,

    /// While true ([`Sched::coalesced`]), a changed leaf's aggregates
    /// (`agg`, `pack`, `idlest`) are not refreshed at once but noted in
    /// `agg_pending` (once per leaf, `agg_dirty`) and refreshed when the
    /// operation ends: nothing reads them inside one (only placement
    /// does, before it starts), and the refreshed state does not depend
    /// on the order or the number of refreshes, so one per changed leaf
    /// replaces one per change.
    agg_defer: bool,
    pub(crate) agg_pending: Vec<LeafId>,
    agg_dirty: Vec<bool>,

    /// The fast start of a woken task that starts at once
    /// ([`Sched::set_fast_start`]).
    fast_start: FastStart,
}

/// The switch of the fast start ([`Sched::set_fast_start`]) and how often
/// it was taken (for tests that compare it with the slow path).
#[derive(Debug)]
struct FastStart {
    on: bool,
    taken: u64,
    /// The shortcuts that skip work whose outcome is known
    /// ([`Sched::set_shortcuts`]).
    shortcuts: bool,
}

impl Sched {
    /// An engine over `topo` with every leaf of capacity `capacity`.
    pub fn new(topo: Arc<Topology>, capacity: u32, config: SchedConfig) -> Self {
        let caps = vec![capacity; topo.nr_leaves()];
        Self::with_capacities(topo, &caps, config)
    }

    /// An engine with per-leaf capacities (`capacities[leaf]`; missing
    /// entries are 0).
    pub fn with_capacities(topo: Arc<Topology>, capacities: &[u32], config: SchedConfig) -> Self {
        let n = topo.nr_leaves();
        let avg_idle = 2 * config.migration_cost;
        let rqs = (0..n)
            .map(|l| RunQueue::new(capacities.get(l).copied().unwrap_or(0), avg_idle))
            .collect();
        let (steal_llc_allowed, steal_cross_allowed) = steal_gating(&topo, &config);
        let domains = DomainHeads::new(&topo, &config, steal_llc_allowed, &steal_cross_allowed);
        let mut s = Self {
            overload: OverloadMasks::new(&topo),
            llc_demands: LlcDemands::new(&topo),
            steal_skip: true,
            busy: BusyFlags::new(&topo),
            nohz: NohzMask::new(n),
            leaf_agg: vec![LeafAgg::default(); n],
            dom_agg: vec![NodeAgg::default(); topo.nodes().len() - n],
            pack: PackIndex::new(&topo),
            idlest: IdlestIndex::new(&topo),
            topo,
            config,
            rqs,
            tasks: IdMap::default(),
            stats: Schedstats::default(),
            events: Vec::new(),
            seq: 0,
            steal_llc_allowed,
            steal_cross_allowed,
            last_now: 0,
            nr_waiting: 0,
            domains,
            tick_pending: vec![OptTime::NONE; n],
            nr_reweighted: vec![0; n],
            pred_missed: vec![OptTime::NONE; n],
            lazy_tick: true,

            agg_defer: false,
            agg_pending: Vec::new(),
            agg_dirty: vec![false; n],
            fast_start: FastStart {
                on: true,
                taken: 0,
                shortcuts: true,
            },
        };
        for leaf in 0..n {
            s.refresh_aggregates(leaf);
            let idle = s.rqs[leaf].is_idle();
            if idle {
                s.rqs[leaf].idle_stamp.set(Some(0));
            }
            s.busy.set_leaf(&s.topo, leaf, !idle);
            let ticking = !idle || !s.rqs[leaf].is_empty();
            s.nohz.set(leaf, ticking);
        }
        s
    }

    // ----- queries -----

    /// Per LLC, the demands of the tasks waiting on its leaves.
    pub fn llc_demands(&self) -> &LlcDemands {
        &self.llc_demands
    }

    /// Turn the steal searches' skip of sources that cannot supply a
    /// fitting task off (the full walk) or on (the default). The decisions
    /// are the same either way; for tests that compare the two.
    #[doc(hidden)]
    pub fn set_steal_skip(&mut self, on: bool) {
        self.steal_skip = on;
    }

    /// The topology.
    pub fn topology(&self) -> &Arc<Topology> {
        &self.topo
    }

    /// The configuration.
    pub fn config(&self) -> &SchedConfig {
        &self.config
    }

    /// Change feature switches; the topology-derived gating is recomputed.
    /// Turning backfill on or off recomputes every leaf's room and
    /// overload bit at once and lets each leaf run what now fits.
    pub fn set_config(&mut self, config: SchedConfig) {
        let (llc, cross) = steal_gating(&self.topo, &config);
        let backfill_changed = config.backfill != self.config.backfill;
        let domains_changed = config.domain_reservation != self.config.domain_reservation
            || config.domain_fifo != self.config.domain_fifo
            || config.shortest_limit_first != self.config.shortest_limit_first
            || config.deadline_order != self.config.deadline_order
            || config.limit_aging != self.config.limit_aging
            || config.widest_first != self.config.widest_first
            || config.latency != self.config.latency
            || config.steal != self.config.steal
            || config.steal_cross_llc != self.config.steal_cross_llc
            || llc != self.steal_llc_allowed
            || cross != self.steal_cross_allowed;
        // Domains matter to scheduling only while one of their switches is
        // (or was) on: otherwise a change of steal gating alone must not
        // run scheduling passes (they would steal) as it never did.
        let domains_active = config.domain_reservation
            || config.domain_fifo
            || self.config.domain_reservation
            || self.config.domain_fifo;
        self.config = config;
        self.steal_llc_allowed = llc;
        self.steal_cross_allowed = cross;
        if backfill_changed || domains_changed {
            self.rebuild_domains();
        }
        if backfill_changed || (domains_changed && domains_active) {
            let now = self.last_now;
            for leaf in 0..self.rqs.len() {
                self.rq_changed(leaf, now);
            }
            for leaf in 0..self.rqs.len() {
                self.schedule(leaf, now);
            }
        }
    }

    /// The run queue of a leaf.
    pub fn rq(&self, leaf: LeafId) -> &RunQueue {
        &self.rqs[leaf]
    }

    /// A task, with its execution accounted up to its leaf's latest tick
    /// as the eager tick would have (`sum_exec_runtime`, `vruntime`,
    /// `exec_start`): borrowed, or a settled copy when that tick's
    /// accounting is still deferred.
    pub fn task(&self, id: TaskId) -> Option<Cow<'_, Task>> {
        let t = self.tasks.get(&id)?;
        if let TaskState::Running(leaf) = t.state
            && let Some(at) = self.tick_pending[leaf].get()
            && at > t.exec_start
        {
            let mut t = t.clone();
            account_task(&mut t, at);
            return Some(Cow::Owned(t));
        }
        Some(Cow::Borrowed(t))
    }

    /// Whether the engine holds task `id`: [`Sched::task`]`.is_some()`
    /// without bringing a lazily ticked task's accounting up to date.
    #[inline]
    pub fn has_task(&self, id: TaskId) -> bool {
        self.tasks.contains_key(&id)
    }

    /// Where task `id` is: [`Sched::task`]'s `state`, which the deferred
    /// accounting of a lazy tick never changes, read without a copy.
    #[inline]
    pub fn task_state(&self, id: TaskId) -> Option<TaskState> {
        self.tasks.get(&id).map(|t| t.state)
    }

    /// A leaf's `min_vruntime`, as the eager tick would have left it.
    pub fn min_vruntime(&self, leaf: LeafId) -> i64 {
        let rq = &self.rqs[leaf];
        let Some(at) = self.tick_pending[leaf].get() else {
            return rq.min_vruntime;
        };
        let mut m: Option<i64> = rq.first_fair().map(|k| k.0);
        for id in &rq.running {
            if let Some(t) = self.tasks.get(id) {
                let v =
                    t.vruntime + calc_delta_fair(at.saturating_sub(t.exec_start), t.weight) as i64;
                m = Some(m.map_or(v, |x| x.min(v)));
            }
        }
        m.map_or(rq.min_vruntime, |m| rq.min_vruntime.max(m))
    }

    /// The time of `leaf`'s latest tick whose accounting is deferred.
    #[doc(hidden)]
    pub fn tick_pending(&self, leaf: LeafId) -> Option<u64> {
        self.tick_pending[leaf].get()
    }

    /// Turn the lazy tick off (every tick accounts at once, the previous
    /// code) or on (the default). Values and decisions are the same either
    /// way; for tests that compare the two. Turning it off settles first.
    #[doc(hidden)]
    pub fn set_lazy_tick(&mut self, on: bool) {
        if !on {
            self.settle_all();
        }
        self.lazy_tick = on;
    }

    /// Turn the fast start of a woken task that starts at once off (every
    /// wakeup enqueues the task and `schedule` starts it, the previous
    /// path) or on (the default). Values, events and decisions are the
    /// same either way; for tests and benchmarks that compare the two.
    #[doc(hidden)]
    pub fn set_fast_start(&mut self, on: bool) {
        self.fast_start.on = on;
    }

    /// Turn off (or on, the default) the shortcuts that skip work whose
    /// outcome is known: the latency pull with no overloaded leaf
    /// anywhere (its only candidates), the domain queue's search with
    /// nothing waiting in the domain, and the second `update_min_vruntime`
    /// of a running task's dequeue ([`Sched::block`]). Values, events,
    /// schedstats and state are the same either way; for tests that
    /// compare the two.
    #[doc(hidden)]
    pub fn set_shortcuts(&mut self, on: bool) {
        self.fast_start.shortcuts = on;
    }

    pub(crate) fn shortcuts(&self) -> bool {
        self.fast_start.shortcuts
    }

    /// How many wakeups took the fast start.
    #[doc(hidden)]
    pub fn fast_starts(&self) -> u64 {
        self.fast_start.taken
    }

    /// Do every leaf's deferred tick accounting now. Nothing a caller can
    /// read changes; the engine's state (its Debug form) becomes the one
    /// the eager tick leaves.
    pub fn settle_all(&mut self) {
        for leaf in 0..self.rqs.len() {
            self.settle(leaf);
        }
    }

    /// Number of tasks known.
    pub fn nr_tasks(&self) -> usize {
        self.tasks.len()
    }

    /// The schedstats.
    pub fn stats(&self) -> &Schedstats {
        &self.stats
    }

    /// The overload masks.
    pub fn overload_masks(&self) -> &OverloadMasks {
        &self.overload
    }

    /// The busy flags.
    pub fn busy_flags(&self) -> &BusyFlags {
        &self.busy
    }

    /// The leaves whose tick runs (NO_HZ idle: all but the empty idle
    /// ones).
    pub fn nohz_mask(&self) -> &NohzMask {
        &self.nohz
    }

    /// Aggregates of a tree node, as last refreshed (inside a deferral,
    /// maybe stale: [`Sched::aggregate`] checks).
    #[inline]
    pub(crate) fn agg(&self, node: NodeId) -> NodeAgg {
        match node.checked_sub(self.leaf_agg.len()) {
            None => self.leaf_agg[node].into(),
            Some(d) => self.dom_agg[d],
        }
    }

    /// Aggregates of a tree node.
    pub fn aggregate(&self, node: NodeId) -> NodeAgg {
        debug_assert!(self.agg_pending.is_empty(), "aggregates read stale");
        self.agg(node)
    }

    /// Take the events produced since the last call.
    pub fn drain_events(&mut self) -> Vec<SchedEvent> {
        std::mem::take(&mut self.events)
    }

    /// [`Sched::drain_events`] into the caller's buffer, which is cleared
    /// first; the engine keeps the buffer's old allocation for the next
    /// events (no allocation per drain when the caller reuses one).
    pub fn drain_events_into(&mut self, out: &mut Vec<SchedEvent>) {
        out.clear();
        std::mem::swap(&mut self.events, out);
    }

    /// Discard events (for callers that only read state).
    pub fn clear_events(&mut self) {
        self.events.clear();
    }

    // ----- tasks -----

    /// Register a sleeping task.
    pub fn add_task(&mut self, spec: TaskSpec) -> Result<(), SchedError> {
        // One probe of the map for the duplicate test and the insert (a
        // task is added on every placement).
        let std::collections::hash_map::Entry::Vacant(slot) = self.tasks.entry(spec.id) else {
            return Err(SchedError::DuplicateTask(spec.id));
        };
        if !nice_in_range(spec.nice) {
            return Err(SchedError::BadNice {
                field: "nice",
                value: spec.nice,
            });
        }
        if !nice_in_range(spec.latency_nice) {
            return Err(SchedError::BadNice {
                field: "latency_nice",
                value: spec.latency_nice,
            });
        }
        if spec.demand == 0 {
            return Err(SchedError::ZeroDemand);
        }
        if let Some(a) = &spec.affinity
            && !a.iter().any(|l| l < self.topo.nr_leaves())
        {
            return Err(SchedError::EmptyAffinity(spec.id));
        }
        slot.insert(Task::new(
            spec,
            self.config.default_policy,
            self.config.sched_latency,
        ));
        Ok(())
    }

    /// `set_cpus_allowed_ptr`: replace task `id`'s affinity (`None`:
    /// every leaf). Only where the task may stay: a runnable task's leaf
    /// must be in the new set (`NotAllowed` otherwise; the kernel would
    /// migrate it, which no caller here needs). Steals and pulls read the
    /// affinity when they look (`can_migrate_task_llc`), so nothing else
    /// changes.
    pub fn set_cpus_allowed_ptr(
        &mut self,
        id: TaskId,
        affinity: Option<Arc<LeafSet>>,
    ) -> Result<(), SchedError> {
        let nr_leaves = self.topo.nr_leaves();
        let task = self.tasks.get_mut(&id).ok_or(SchedError::UnknownTask(id))?;
        if let Some(a) = &affinity {
            if !a.iter().any(|l| l < nr_leaves) {
                return Err(SchedError::EmptyAffinity(id));
            }
            if let TaskState::Queued(leaf) | TaskState::Running(leaf) = task.state
                && !a.contains(leaf)
            {
                return Err(SchedError::NotAllowed { task: id, leaf });
            }
        }
        task.affinity = affinity;
        Ok(())
    }

    /// Remove a task (exit). A runnable task is dequeued first and its leaf
    /// rescheduled.
    pub fn remove_task(&mut self, id: TaskId, now: u64) -> Result<Task, SchedError> {
        self.coalesced(|s| s.block(id, now))?;
        self.tasks.remove(&id).ok_or(SchedError::UnknownTask(id))
    }

    /// [`Sched::remove_task`] of a task whose end also frees room the
    /// caller models on `leaf` (a machine's CPUs): `summary` is the leaf's
    /// room after the release, as [`Sched::set_free_summary`] takes it.
    /// When the task is on `leaf` the room is set before the removal
    /// refreshes and reschedules the leaf, so the leaf and the aggregates
    /// up the tree are refreshed once (and the leaf runs and steals
    /// against its real room), where `remove_task` then
    /// `set_free_summary` did both twice. A task elsewhere (or sleeping)
    /// is removed first and the room set after, as those two calls.
    pub fn remove_task_freeing(
        &mut self,
        id: TaskId,
        leaf: LeafId,
        summary: Option<FreeSummary>,
        now: u64,
    ) -> Result<Task, SchedError> {
        self.check_leaf(leaf)?;
        let state = self
            .tasks
            .get(&id)
            .ok_or(SchedError::UnknownTask(id))?
            .state;
        if matches!(state, TaskState::Queued(l) | TaskState::Running(l) if l == leaf) {
            self.rqs[leaf].align_free = summary.map(FreeSummary::normalized);
            self.remove_task(id, now)
        } else {
            let task = self.remove_task(id, now)?;
            self.set_free_summary(leaf, summary, now)?;
            Ok(task)
        }
    }

    fn check_leaf(&self, leaf: LeafId) -> Result<(), SchedError> {
        if leaf < self.topo.nr_leaves() {
            Ok(())
        } else {
            Err(SchedError::BadLeaf {
                leaf,
                nr_leaves: self.topo.nr_leaves(),
            })
        }
    }

    /// Wake a sleeping task (or start a new one): choose a leaf with
    /// `select_task_rq`, enqueue it there, preempt if it should, run what
    /// fits. `waker` is the task that woke it (its wakee_flips are
    /// recorded); `sync` says the waker is about to sleep.
    pub fn wake_up(
        &mut self,
        id: TaskId,
        waker: Option<TaskId>,
        sync: bool,
        now: u64,
    ) -> Result<LeafId, SchedError> {
        self.wake_up_placed(id, waker, sync, now)
            .map(|(leaf, _)| leaf)
    }

    /// [`Sched::wake_up`], with how `select_task_rq` chose the leaf.
    pub fn wake_up_placed(
        &mut self,
        id: TaskId,
        waker: Option<TaskId>,
        sync: bool,
        now: u64,
    ) -> Result<(LeafId, Placement), SchedError> {
        let task = self.tasks.get(&id).ok_or(SchedError::UnknownTask(id))?;
        if task.state != TaskState::Sleeping {
            return Err(SchedError::AlreadyRunnable(id));
        }
        let (leaf, how) = self.select_task_rq_placed(id, waker, sync, now);
        self.coalesced(|s| s.activate(id, leaf, now));
        Ok((leaf, how))
    }

    /// [`Sched::wake_up_placed`] for a caller that models the leaf's room
    /// and reports it after a start ([`Sched::set_free_summary`], e.g. the
    /// dispatcher's claim of the job's CPUs): when the task starts at once
    /// and the leaf's refresh after the start could do nothing that the
    /// report's refresh does not redo ([`Sched::start_claimable`]),
    /// `claim(leaf)` is called at the start; the room it returns
    /// (`Some(summary)`, as `set_free_summary` takes it) is set then, and
    /// the leaf is refreshed and rescheduled once instead of twice. The
    /// state, events and schedstats are those of `wake_up_placed`
    /// followed at once by `set_free_summary(leaf, summary, now)`. When
    /// `claim` is not called, or returns `None`, this is `wake_up_placed`
    /// and the caller reports the room as before. Returns also whether
    /// the room was set.
    pub fn wake_up_placed_claiming(
        &mut self,
        id: TaskId,
        waker: Option<TaskId>,
        sync: bool,
        now: u64,
        claim: impl FnOnce(LeafId) -> Option<Option<FreeSummary>>,
    ) -> Result<(LeafId, Placement, bool), SchedError> {
        let task = self.tasks.get(&id).ok_or(SchedError::UnknownTask(id))?;
        if task.state != TaskState::Sleeping {
            return Err(SchedError::AlreadyRunnable(id));
        }
        let (leaf, how) = self.select_task_rq_placed(id, waker, sync, now);
        let claimed = self.coalesced(|s| s.activate_with(id, leaf, now, Some(claim)));
        Ok((leaf, how, claimed))
    }

    /// [`Sched::wake_up_on`] with the claim of
    /// [`Sched::wake_up_placed_claiming`]; returns whether the room was
    /// set.
    pub fn wake_up_on_claiming(
        &mut self,
        id: TaskId,
        leaf: LeafId,
        now: u64,
        claim: impl FnOnce(LeafId) -> Option<Option<FreeSummary>>,
    ) -> Result<bool, SchedError> {
        self.check_wake_on(id, leaf)?;
        Ok(self.coalesced(|s| s.activate_with(id, leaf, now, Some(claim))))
    }

    /// Wake a sleeping task on a leaf chosen by the caller.
    pub fn wake_up_on(&mut self, id: TaskId, leaf: LeafId, now: u64) -> Result<(), SchedError> {
        self.check_wake_on(id, leaf)?;
        self.coalesced(|s| s.activate(id, leaf, now));
        Ok(())
    }

    /// Whether sleeping task `id` may be woken on `leaf` (the checks of
    /// [`Sched::wake_up_on`]).
    fn check_wake_on(&self, id: TaskId, leaf: LeafId) -> Result<(), SchedError> {
        self.check_leaf(leaf)?;
        let task = self.tasks.get(&id).ok_or(SchedError::UnknownTask(id))?;
        if task.state != TaskState::Sleeping {
            return Err(SchedError::AlreadyRunnable(id));
        }
        if !task.allowed(leaf) {
            return Err(SchedError::NotAllowed { task: id, leaf });
        }
        Ok(())
    }

    fn activate(&mut self, id: TaskId, leaf: LeafId, now: u64) {
        self.activate_with(
            id,
            leaf,
            now,
            None::<fn(LeafId) -> Option<Option<FreeSummary>>>,
        );
    }

    /// [`Sched::activate`]; with `claim`, a fast start may take the
    /// caller's room report at once ([`Sched::wake_up_placed_claiming`]).
    /// Returns whether it did.
    fn activate_with(
        &mut self,
        id: TaskId,
        leaf: LeafId,
        now: u64,
        claim: Option<impl FnOnce(LeafId) -> Option<Option<FreeSummary>>>,
    ) -> bool {
        let prev = self.tasks[&id].prev_leaf;
        if let Some(prev) = prev
            && prev != leaf
        {
            self.stats.nr_migrations += 1;
            let delta = self.min_vruntime(leaf) - self.min_vruntime(prev);
            if let Some(t) = self.tasks.get_mut(&id) {
                t.vruntime += delta;
            }
        }
        self.place_entity(id, leaf);
        if self.fast_start.on && self.starts_at_once(id, leaf, now) {
            return self.start_at_once(id, leaf, now, claim);
        }
        self.enqueue_task(id, leaf, true, now);
        self.check_preempt_wakeup(leaf, id, now);
        self.schedule(leaf, now);
        false
    }

    /// True when the wakeup of `id` on `leaf` (placed, not yet enqueued)
    /// would start it at once and nothing else before it: the path above
    /// (`enqueue_task`, `check_preempt_wakeup`, `schedule`) would enqueue
    /// it, start it as the first thing that changes anything, and go on
    /// from the state the fast start ([`Sched::start_at_once`]) reaches
    /// directly. Each condition is what makes one step of that path
    /// certain:
    /// - nothing waits on the leaf: the task is its pick (`next_startable`);
    /// - it can start there now (room for its demand and alignment; so
    ///   `check_preempt_wakeup` returns at once, its capacity fits);
    /// - the latency pull, run first by `schedule`, can pull nothing: no
    ///   latency-class task waits in its search's reach (the leaf's LLC,
    ///   or its sibling group with cross-LLC stealing);
    /// - with one reservation per domain, the task's head key would not
    ///   take the domain's reservation from another leaf (that leaf would
    ///   be refreshed and rescheduled): no head waits in the domain, or
    ///   the first waits since `now` or earlier (the new key, with the
    ///   newest sequence, sorts after it);
    /// - with one queue per domain, `fifo_pull` would take the task first:
    ///   it may run on the leaf and no task of the domain's queue that
    ///   sorts before it could start on the leaf
    ///   ([`Sched::fifo_starts_first`]).
    #[inline]
    fn starts_at_once(&self, id: TaskId, leaf: LeafId, now: u64) -> bool {
        let rq = &self.rqs[leaf];
        if !rq.nothing_waits() {
            return false;
        }
        let Some(t) = self.tasks.get(&id) else {
            return false;
        };
        if !rq.can_start(t.demand, t.align) || !rq.has_spare() {
            return false;
        }
        let c = &self.config;
        if c.latency_pull && c.latency && c.steal && self.steal_llc_allowed {
            let llc = self.topo.llc_of(leaf);
            let reach = if c.steal_cross_llc && self.steal_cross_allowed[llc] {
                self.llc_demands.group_latency(llc)
            } else {
                self.llc_demands.latency(llc)
            };
            if !reach.is_empty() {
                return false;
            }
        }
        if !self.domains.head_sorts_last(leaf, now) {
            return false;
        }
        !self.domains.fifo
            || (t.allowed(leaf) && self.fifo_starts_first(leaf, t, now, self.seq + 1))
    }

    /// The fast start of a woken task that starts at once
    /// ([`Sched::starts_at_once`]): the same task, queue, flags, events
    /// and schedstats as `enqueue_task` then `set_next`, without the wait
    /// structures' insert and remove (two timelines, three demand sets,
    /// the domain's queue and head) and with one `rq_changed` instead of
    /// two. The slow path's first `rq_changed`, with the task waiting,
    /// leaves nothing behind that the second does not overwrite: the
    /// overload bit is set and cleared, the head key inserted and removed
    /// (the domain's reservation does not move, `starts_at_once`), the
    /// idle stamp and room recomputed; and the busy flag it may clear
    /// (the leaf idle, with room left beside its waiting head) is
    /// already clear, the leaf being idle before the wakeup (no domain
    /// above an idle leaf is flagged busy). What is redone is the latency
    /// pull that `schedule` runs before the start: it pulls nothing, but
    /// counts what it scans. Then `schedule` goes on where the start left
    /// it: inside `fifo_pull` with one queue per domain (the latency pull
    /// not run again before it), after `set_next` in the pick loop
    /// otherwise.
    ///
    /// With `claim` ([`Sched::wake_up_placed_claiming`]), when
    /// [`Sched::start_claimable`] holds after the start, the caller's room
    /// is taken there and the refresh and schedule run once, as the
    /// room report's (`set_free_summary`) would after them. Returns
    /// whether the room was taken.
    fn start_at_once(
        &mut self,
        id: TaskId,
        leaf: LeafId,
        now: u64,
        claim: Option<impl FnOnce(LeafId) -> Option<Option<FreeSummary>>>,
    ) -> bool {
        // The latency pull `schedule` runs first on the slow path, with the
        // task waiting: nothing in its reach (`starts_at_once`), it only
        // counts what it scans. It reads nothing `make_runnable` changes.
        let pulled = self.latency_pull(leaf, now);
        debug_assert_eq!(pulled, 0, "the fast start's latency pull moved a task");
        if pulled > 0 {
            // Not reached; were it, the task is not started past the
            // room the pull took: the slow path goes on from here.
            self.enqueue_task(id, leaf, true, now);
            self.check_preempt_wakeup(leaf, id, now);
            self.schedule(leaf, now);
            return false;
        }
        if self.make_runnable(id, leaf, true, now).is_none() {
            return false;
        }
        self.run_on(id, leaf, now);
        self.fast_start.taken += 1;
        if let Some(claim) = claim
            && self.start_claimable()
            && let Some(summary) = claim(leaf)
        {
            // The schedule after the start, with the room the start left
            // (`run_on`'s conservative one): nothing waits and nothing is
            // overloaded, so it takes its shortcut and only counts the
            // steal attempt's gates, which read the room but nothing the
            // refresh writes (and no leaf that lost its domain's
            // reservation waits for its schedule).
            self.steal_gates_only(leaf, now);
            debug_assert!(
                self.nr_waiting == 0 && self.overload.total() == 0,
                "the start's schedule changed the queues"
            );
            // Then the report: `set_free_summary`'s refresh and schedule,
            // which overwrite everything the start's refresh would have
            // written (`start_claimable`).
            self.rqs[leaf].align_free = summary.map(FreeSummary::normalized);
            self.rq_changed(leaf, now);
            self.schedule(leaf, now);
            return true;
        }
        self.rq_changed(leaf, now);
        self.schedule_after_start(leaf, now, self.domains.fifo);
        false
    }

    /// After a fast start ([`Sched::start_at_once`], before the leaf's
    /// refresh): true when that refresh and the schedule after it, made
    /// with the start's conservative room, leave nothing that a room
    /// report's refresh and schedule made at once after them
    /// (`set_free_summary` at the same `now`) do not overwrite, but the
    /// schedstats of the steal attempt's gates. Then the two refreshes
    /// are one. What makes each part certain:
    /// - nothing waits anywhere and no leaf is overloaded (the leaf was
    ///   not before, with nothing waiting on it, and the start does not
    ///   make it so): the schedule takes its shortcut (with
    ///   [`Sched::set_shortcuts`] on), which starts, pulls and steals
    ///   nothing and reads the leaf's room, not what the refresh writes;
    ///   and no leaf that lost its domain's reservation waits for the
    ///   schedule that follows it (`domains.deferred`);
    /// - the leaf's head key stays none (nothing waits on it, before or
    ///   after), so no domain reservation moves;
    /// - the refresh's other writes are functions of the leaf's state,
    ///   which the report's refresh writes again: its room for
    ///   newcomers (none waiting), overload bit (unchanged), tick mask,
    ///   the aggregates (deferred to the operation's end), and the idle
    ///   stamp and busy flag: the start took the stamp (it is `now` if
    ///   either refresh sees the leaf idle with the same `now`), and the
    ///   leaf was idle before the start (room for the task), so no
    ///   domain above it is flagged busy and marking it idle clears
    ///   nothing.
    fn start_claimable(&self) -> bool {
        self.nr_waiting == 0
            && self.overload.total() == 0
            && self.shortcuts()
            && self.domains.deferred.is_empty()
    }

    /// The task stops being runnable (sleeps on I/O, a message, a
    /// dependency). Its leaf then runs the next task, or goes idle and tries
    /// to steal. A sleeping task is left as it is.
    pub fn block(&mut self, id: TaskId, now: u64) -> Result<(), SchedError> {
        let task = self.tasks.get(&id).ok_or(SchedError::UnknownTask(id))?;
        match task.state {
            TaskState::Sleeping => Ok(()),
            TaskState::Queued(leaf) => {
                self.dequeue_task(id, leaf, now);
                // The head of the queue may have been what blocked the
                // others (a big task waiting for room): run what fits now.
                self.schedule(leaf, now);
                Ok(())
            }
            TaskState::Running(leaf) => {
                // `update_curr` then the dequeue, with one
                // `update_min_vruntime`: the dequeue's (after the task
                // left the running set) makes the earlier one's moot, as
                // the smallest vruntime of fewer tasks is no smaller;
                // only when nothing is left does the task's own count.
                if !self.shortcuts() {
                    self.update_curr(id, now);
                    self.dequeue_task(id, leaf, now);
                    self.schedule(leaf, now);
                    return Ok(());
                }
                self.settle(leaf);
                let accounted = self
                    .tasks
                    .get_mut(&id)
                    .and_then(|t| account_task(t, now))
                    .is_some();
                self.dequeue_task_from(id, leaf, now, accounted);
                self.schedule(leaf, now);
                Ok(())
            }
        }
    }

    /// Change a leaf's capacity (a node's schedulable CPUs changed, or a
    /// CPU went offline: capacity 0). Overload and idle state follow.
    pub fn set_capacity(
        &mut self,
        leaf: LeafId,
        capacity: u32,
        now: u64,
    ) -> Result<(), SchedError> {
        self.check_leaf(leaf)?;
        self.rqs[leaf].capacity = capacity;
        // Running tasks beyond the new capacity are preempted (latest first).
        while self.rqs[leaf].running_demand > capacity {
            let Some(&last) = self.rqs[leaf].running.last() else {
                break;
            };
            self.put_prev(last, leaf, now);
        }
        self.rq_changed(leaf, now);
        self.schedule(leaf, now);
        Ok(())
    }

    /// Set a machine leaf's room per alignment level (from its agent's
    /// report, or the caller's model of its CPUs); `None` = no alignment
    /// constraint inside the leaf.
    pub fn set_free_summary(
        &mut self,
        leaf: LeafId,
        summary: Option<FreeSummary>,
        now: u64,
    ) -> Result<(), SchedError> {
        self.check_leaf(leaf)?;
        self.rqs[leaf].align_free = summary.map(FreeSummary::normalized);
        self.coalesced(|s| {
            s.rq_changed(leaf, now);
            s.schedule(leaf, now);
        });
        Ok(())
    }

    /// The tick of one leaf: account the running tasks' time, end slices
    /// that are used up (when time-slicing), and flag busy domains lazily.
    ///
    /// The accounting is deferred (a lazy tick): the leaf records the
    /// tick's time and does the accounting when it next changes (a task
    /// starts, stops, is preempted, woken onto it or moved off it); reads
    /// of what it writes compute it ([`Sched::task`],
    /// [`Sched::min_vruntime`], a wakeup's or a steal's vruntime shift, a
    /// reservation's expected ends). A nice-0 task's `calc_delta_fair` is
    /// the identity, so `sum_exec_runtime`, `vruntime` and `exec_start`
    /// come out the same whether the time since `exec_start` is accounted
    /// at every tick or once at the latest; and between changes a leaf's
    /// smallest vruntime only rises, so `min_vruntime` after several ticks
    /// is what the latest tick alone sets. A leaf ticks eagerly when the
    /// tick must decide something (time slices: `preempt` with tasks
    /// waiting) or a running task is not nice-0 (its vruntime rounds at
    /// every accounting). On a 100,000-node cluster this leaves one store
    /// per busy leaf per tick, instead of a task lookup per running task.
    pub fn tick(&mut self, leaf: LeafId, now: u64) {
        let rq = &self.rqs[leaf];
        let slices = self.config.preempt && !rq.nothing_waits();
        if self.lazy_tick && !slices && self.nr_reweighted[leaf] == 0 {
            // Nothing running or waiting: nothing to account, now or later
            // (and nothing recorded, so that the state is the same whether
            // such a leaf is ticked or skipped, `tick_all`).
            if rq.nr_running > 0 {
                let at = &mut self.tick_pending[leaf];
                at.set(Some(at.get().map_or(now, |at| at.max(now))));
            }
        } else {
            self.settle(leaf);
            self.tick_account(leaf, now);
            if slices {
                let running = self.rqs[leaf].running.to_vec();
                for &id in &running {
                    if self.check_preempt_tick(leaf, id) {
                        self.resched(leaf, id, now);
                    }
                }
            }
        }
        let rqs = &self.rqs;
        self.busy.tick(&self.topo, leaf, |l| !rqs[l].is_idle());
    }

    /// The tick's accounting of one leaf at `now`: `update_curr` of every
    /// running task, and `update_min_vruntime` taken on the way (one
    /// lookup per running task). The run queue does not change: index
    /// instead of cloning the running set.
    fn tick_account(&mut self, leaf: LeafId, now: u64) {
        let rq = &self.rqs[leaf];
        let mut m: Option<i64> = rq.first_fair().map(|k| k.0);
        for &id in &rq.running {
            if let Some(t) = self.tasks.get_mut(&id) {
                account_task(t, now);
                m = Some(m.map_or(t.vruntime, |x| x.min(t.vruntime)));
            }
        }
        if let Some(m) = m {
            let rq = &mut self.rqs[leaf];
            rq.min_vruntime = rq.min_vruntime.max(m);
        }
    }

    /// Do `leaf`'s deferred tick accounting, if any: before anything
    /// changes the leaf's queue, its running set or its running tasks'
    /// accounting. Several deferred ticks account as their latest one (see
    /// [`Sched::tick`]). Reads do not settle: they compute the settled
    /// values ([`Sched::min_vruntime`], [`Sched::task`]), so that engines
    /// that only read differently keep the same state.
    pub(crate) fn settle(&mut self, leaf: LeafId) {
        if let Some(at) = self.tick_pending[leaf].take() {
            self.tick_account(leaf, at);
        }
    }

    /// `id` starts (`on`) or stops running on `leaf`: the leaf's count of
    /// running tasks that are not nice-0 follows.
    fn count_reweighted(&mut self, id: TaskId, leaf: LeafId, on: bool) {
        if self.tasks.get(&id).is_some_and(|t| t.weight != NICE_0_LOAD) {
            if on {
                self.nr_reweighted[leaf] += 1;
            } else {
                self.nr_reweighted[leaf] -= 1;
            }
        }
    }

    /// The periodic tick of the whole topology: [`Sched::tick`] of every
    /// leaf in leaf order, except the leaves whose tick is stopped
    /// ([`NohzMask`]: empty and idle, where the tick does nothing). The
    /// same state as ticking every leaf, at O(leaves with work) instead of
    /// O(leaves): a 100,000-node cluster with 3% of its nodes busy ticks
    /// 3,000 leaves. The mask is read as it changes, so a leaf that gains
    /// work during the pass (a preemption on an earlier leaf stole into
    /// it) is still ticked when the pass reaches it, as the full loop
    /// would.
    pub fn tick_all(&mut self, now: u64) {
        let mut next = self.nohz.next_ticking(0);
        while let Some(leaf) = next {
            self.tick(leaf, now);
            next = self.nohz.next_ticking(leaf + 1);
        }
    }

    // ----- the fair class -----

    /// `place_entity` on wakeup: a sleeper gets at most half a latency
    /// period of credit (GENTLE_FAIR_SLEEPERS); a new task starts at
    /// `min_vruntime`.
    #[inline]
    fn place_entity(&mut self, id: TaskId, leaf: LeafId) {
        let min_vruntime = self.min_vruntime(leaf);
        let thresh = (self.config.sched_latency / 2) as i64;
        if let Some(t) = self.tasks.get_mut(&id) {
            if t.prev_leaf.is_none() && t.sum_exec_runtime == 0 {
                t.vruntime = min_vruntime;
            } else {
                t.vruntime = t.vruntime.max(min_vruntime - thresh);
            }
        }
    }

    /// Put a runnable task in a leaf's queue (`enqueue_task_fair`).
    pub(crate) fn enqueue_task(&mut self, id: TaskId, leaf: LeafId, wakeup: bool, now: u64) {
        let Some(seq) = self.make_runnable(id, leaf, wakeup, now) else {
            return;
        };
        let latency_enabled = self.config.latency;
        let llc = self.topo.llc_of(leaf);
        let Some(t) = self.tasks.get_mut(&id) else {
            return;
        };
        let rq = &mut self.rqs[leaf];
        if rq.enqueue_fair((t.vruntime, seq, id), t.demand, t.is_bounded()) {
            self.nr_waiting += 1;
        }
        self.llc_demands.wait_insert(llc, t.demand);
        self.domains.wait_insert(leaf, t);
        if latency_enabled && t.latency_offset < 0 && wakeup {
            rq.enqueue_latency((t.vruntime + t.latency_offset, seq, id), t.demand);
            self.llc_demands.latency_insert(llc, t.demand);
            t.in_latency_tree = true;
        }
        self.rq_changed(leaf, now);
    }

    /// The part of [`Sched::enqueue_task`] that does not depend on where
    /// the task waits, shared with the fast start
    /// ([`Sched::start_at_once`]): the leaf's deferred tick settled, a new
    /// enqueue sequence, the task runnable on `leaf`, the leaf's idle
    /// period ended and its runnable demand and load counted. Returns the
    /// sequence (`None` for an unknown task).
    fn make_runnable(&mut self, id: TaskId, leaf: LeafId, wakeup: bool, now: u64) -> Option<u64> {
        self.settle(leaf);
        self.seq += 1;
        let seq = self.seq;
        let t = self.tasks.get_mut(&id)?;
        t.state = TaskState::Queued(leaf);
        t.prev_leaf = Some(leaf);
        t.enqueue_seq = seq;
        if wakeup {
            t.queued_at = now;
        }
        let rq = &mut self.rqs[leaf];
        if let Some(stamp) = rq.idle_stamp.take()
            && wakeup
        {
            // Leaving idle by a wakeup: update avg_idle as ttwu_do_wakeup
            // does. A steal leaves it alone, as the seed's newidle path.
            let delta = now.saturating_sub(stamp) as i64;
            let avg = rq.avg_idle as i64;
            rq.avg_idle = (avg + (delta - avg) / 8).max(0) as u64;
            rq.avg_idle = rq.avg_idle.min(2 * self.config.migration_cost);
        }
        rq.nr_running += t.demand;
        rq.load_weight += t.weight;
        Some(seq)
    }

    /// Put a waiting task of `leaf` in its latency timeline too
    /// (`__enqueue_latency`), when latency-nice is on and the task is
    /// latency-sensitive.
    fn enqueue_latency(&mut self, id: TaskId, leaf: LeafId) {
        if !self.config.latency {
            return;
        }
        let Some(t) = self.tasks.get_mut(&id) else {
            return;
        };
        if t.latency_offset >= 0 || t.in_latency_tree || t.state != TaskState::Queued(leaf) {
            return;
        }
        self.rqs[leaf]
            .enqueue_latency((t.vruntime + t.latency_offset, t.enqueue_seq, id), t.demand);
        self.llc_demands
            .latency_insert(self.topo.llc_of(leaf), t.demand);
        t.in_latency_tree = true;
    }

    /// Take a task off its leaf (running or waiting) and make it sleep.
    fn dequeue_task(&mut self, id: TaskId, leaf: LeafId, now: u64) {
        self.dequeue_task_from(id, leaf, now, false);
    }

    /// [`Sched::dequeue_task`]; with `accounted`, a running task's
    /// `update_curr` just accounted time without updating `min_vruntime`
    /// ([`Sched::block`]): its vruntime is the floor when no task is left
    /// on the leaf, as that update would have set it.
    fn dequeue_task_from(&mut self, id: TaskId, leaf: LeafId, now: u64, accounted: bool) {
        self.settle(leaf);
        let llc = self.topo.llc_of(leaf);
        // One lookup of the task for the whole dequeue.
        let Some(t) = self.tasks.get_mut(&id) else {
            return;
        };
        let rq = &mut self.rqs[leaf];
        match t.state {
            TaskState::Running(_) => {
                // `count_reweighted(id, leaf, false)`.
                if t.weight != NICE_0_LOAD {
                    self.nr_reweighted[leaf] -= 1;
                }
                if let Some(m) = t.prediction_missed_at(now) {
                    let slot = &mut self.pred_missed[leaf];
                    slot.set(Some(slot.get().map_or(m, |x| x.max(m))));
                }
                // A running task is in `running` once: removing it where
                // it is keeps the others' order, as `retain` did.
                rq.running.remove(id);
                debug_assert!(!rq.running.contains(&id), "task {id:?} ran twice");
                rq.running_demand -= t.demand;
            }
            TaskState::Queued(_) => {
                let latency =
                    t.in_latency_tree
                        .then_some((t.vruntime + t.latency_offset, t.enqueue_seq, id));
                if rq.dequeue_waiting((t.vruntime, t.enqueue_seq, id), t.demand, latency) {
                    self.nr_waiting -= 1;
                }
                self.llc_demands.wait_remove(llc, t.demand);
                self.domains.wait_remove(leaf, t);
                if t.in_latency_tree {
                    self.llc_demands.latency_remove(llc, t.demand);
                    t.in_latency_tree = false;
                }
            }
            TaskState::Sleeping => return,
        }
        rq.nr_running -= t.demand;
        rq.load_weight -= t.weight;
        let floor = accounted.then_some(t.vruntime);
        t.state = TaskState::Sleeping;
        self.update_min_vruntime_or(leaf, floor);
        self.rq_changed(leaf, now);
    }

    /// Detach a waiting task for migration (steal): out of the source
    /// queue with its vruntime made relative to the destination.
    /// A task waiting in the source's latency timeline waits in the
    /// destination's too (seed 004: the timeline exists so that a
    /// latency-sensitive task that could not run at once runs first; a
    /// steal must not drop it to the fair order).
    /// The caller starts the task and then lets the source run what its
    /// leaving lets run (`steal::pull_task`).
    pub(crate) fn migrate_queued(&mut self, id: TaskId, from: LeafId, to: LeafId, now: u64) {
        let was_latency = self.tasks.get(&id).is_some_and(|t| t.in_latency_tree);
        self.dequeue_task(id, from, now);
        let delta = self.min_vruntime(to) - self.min_vruntime(from);
        if let Some(t) = self.tasks.get_mut(&id) {
            t.vruntime += delta;
        }
        self.stats.nr_migrations += 1;
        self.events
            .push(SchedEvent::Migrated { task: id, from, to });
        self.enqueue_task(id, to, false, now);
        if was_latency {
            self.enqueue_latency(id, to);
        }
    }

    /// Account execution since `exec_start` (`update_curr`), after the
    /// leaf's deferred tick.
    fn update_curr(&mut self, id: TaskId, now: u64) {
        let Some(TaskState::Running(leaf)) = self.tasks.get(&id).map(|t| t.state) else {
            return;
        };
        self.settle(leaf);
        if let Some(leaf) = self.tasks.get_mut(&id).and_then(|t| account_task(t, now)) {
            self.update_min_vruntime(leaf);
        }
    }

    fn update_min_vruntime(&mut self, leaf: LeafId) {
        self.update_min_vruntime_or(leaf, None);
    }

    /// `update_min_vruntime`, taking `floor` as the smallest vruntime when
    /// nothing runs or waits on the leaf.
    fn update_min_vruntime_or(&mut self, leaf: LeafId, floor: Option<i64>) {
        let next = self.next_min_vruntime(leaf, floor);
        debug_assert_eq!(next, self.min_vruntime_scan(leaf, floor), "leaf {leaf}");
        self.rqs[leaf].min_vruntime = next;
    }

    /// The leaf's `min_vruntime` after `update_min_vruntime_or`. It only
    /// rises (the larger of itself and the smallest vruntime): once one
    /// candidate is at or below it, nothing changes, so the walk over the
    /// running tasks (a map lookup each) stops there, and does not start
    /// when the leftmost waiting task is. Equal to
    /// [`Sched::min_vruntime_scan`], which debug builds check on every call.
    fn next_min_vruntime(&self, leaf: LeafId, floor: Option<i64>) -> i64 {
        let rq = &self.rqs[leaf];
        let cur = rq.min_vruntime;
        let mut m: Option<i64> = rq.first_fair().map(|k| k.0);
        if m.is_some_and(|x| x <= cur) {
            return cur;
        }
        for id in &rq.running {
            if let Some(t) = self.tasks.get(id) {
                if t.vruntime <= cur {
                    return cur;
                }
                m = Some(m.map_or(t.vruntime, |x| x.min(t.vruntime)));
            }
        }
        m.or(floor).map_or(cur, |m| cur.max(m))
    }

    /// [`Sched::next_min_vruntime`] by the full walk (the kernel's
    /// `update_min_vruntime` over every candidate): the oracle.
    fn min_vruntime_scan(&self, leaf: LeafId, floor: Option<i64>) -> i64 {
        let rq = &self.rqs[leaf];
        let mut m: Option<i64> = rq.first_fair().map(|k| k.0);
        for id in &rq.running {
            if let Some(t) = self.tasks.get(id) {
                m = Some(m.map_or(t.vruntime, |x| x.min(t.vruntime)));
            }
        }
        m.or(floor)
            .map_or(rq.min_vruntime, |m| rq.min_vruntime.max(m))
    }

    /// `wakeup_gran(se)`: the wakeup granularity in `se`'s virtual time.
    fn wakeup_gran(&self, se: &Task) -> i64 {
        calc_delta_fair(self.config.wakeup_granularity, se.weight) as i64
    }

    /// `wakeup_latency_gran(curr, se)` of the latency-nice series that seed
    /// 004's patch 8/8 builds on (v12 5/8, which the seed does not quote;
    /// its patch 8 calls it through `wakeup_preempt_entity(latency, se)`
    /// in `pick_next_entity`): how much the latency offsets shift the
    /// comparison of `curr` and `se`. When either is latency-sensitive
    /// (negative offset) the difference of the offsets counts; otherwise
    /// `se`'s own offset says how much scheduling delay it accepts (positive
    /// latency-nice: `se` preempts later, `curr` keeps running longer).
    /// Capped at `wakeup_gran(se)`:
    /// `latency_offset = min_t(long, latency_offset, wakeup_gran(se))`.
    fn wakeup_latency_gran(&self, curr: &Task, se: &Task) -> i64 {
        let mut offset = se.latency_offset;
        if offset < 0 || curr.latency_offset < 0 {
            offset -= curr.latency_offset;
        }
        offset.min(self.wakeup_gran(se))
    }

    /// `wakeup_preempt_entity(curr, se)`: 1 when `se` should preempt
    /// `curr`, 0 when within a wakeup granularity, -1 when `curr` is ahead.
    pub(crate) fn wakeup_preempt_entity(&self, curr: &Task, se: &Task) -> i32 {
        let mut vdiff = curr.vruntime - se.vruntime;
        if self.config.latency {
            vdiff -= self.wakeup_latency_gran(curr, se);
        }
        if vdiff <= 0 {
            return -1;
        }
        if vdiff > self.wakeup_gran(se) { 1 } else { 0 }
    }

    /// `pick_next_entity`: the leftmost task of the fair timeline, unless
    /// the leftmost latency-sensitive task may go first fairly
    /// (`wakeup_preempt_entity(latency, se) < 1`, seed 004).
    pub(crate) fn pick_next_entity(&self, leaf: LeafId) -> Option<TaskId> {
        let rq = &self.rqs[leaf];
        let left = rq.first_fair()?.2;
        if self.config.latency
            && let Some(lat) = rq.first_latency()
            && lat.2 != left
            && let (Some(l), Some(s)) = (self.tasks.get(&lat.2), self.tasks.get(&left))
            && self.wakeup_preempt_entity(l, s) < 1
        {
            return Some(lat.2);
        }
        Some(left)
    }

    /// The task a leaf would start next, if any: `pick_next_entity`,
    /// except that a task needing more than the leaf's whole capacity (it
    /// can never start here, only be stolen by a bigger leaf) does not
    /// block the queue behind it.
    pub fn next_to_run(&self, leaf: LeafId) -> Option<TaskId> {
        self.next_startable(leaf)
    }

    fn next_startable(&self, leaf: LeafId) -> Option<TaskId> {
        let capacity = self.rqs[leaf].capacity;
        let ever_fits = |id: &TaskId| self.tasks.get(id).is_some_and(|t| t.demand <= capacity);
        let first = self.pick_next_entity(leaf)?;
        if ever_fits(&first) {
            return Some(first);
        }
        self.rqs[leaf].waiting().find(ever_fits)
    }

    /// Waiting tasks of a leaf in next-to-run order: the latency pick (if
    /// any) first, then the fair timeline.
    ///
    /// Lazy: a backfill pass stops at its first candidate, and with
    /// thousands waiting on a node, collecting the whole order first was
    /// most of the dispatcher's core thread under a deep queue.
    pub(crate) fn next_to_run_order(&self, leaf: LeafId) -> impl Iterator<Item = TaskId> + '_ {
        first_then_fair(self.pick_next_entity(leaf), self.rqs[leaf].waiting())
    }

    /// Start a waiting task (`set_next_entity`).
    pub(crate) fn set_next(&mut self, id: TaskId, leaf: LeafId, now: u64) {
        self.settle(leaf);
        // A latency pick: the latency timeline's first, not the fair one's
        // (a backfilled task is neither).
        let latency_first = self.rqs[leaf].first_fair().map(|k| k.2) != Some(id)
            && self.rqs[leaf].first_latency().map(|k| k.2) == Some(id);
        let llc = self.topo.llc_of(leaf);
        let Some(t) = self.tasks.get_mut(&id) else {
            return;
        };
        let rq = &mut self.rqs[leaf];
        let latency =
            t.in_latency_tree
                .then_some((t.vruntime + t.latency_offset, t.enqueue_seq, id));
        if rq.dequeue_waiting((t.vruntime, t.enqueue_seq, id), t.demand, latency) {
            self.nr_waiting -= 1;
        }
        self.llc_demands.wait_remove(llc, t.demand);
        self.domains.wait_remove(leaf, t);
        if t.in_latency_tree {
            self.llc_demands.latency_remove(llc, t.demand);
            t.in_latency_tree = false;
        }
        if latency_first {
            self.stats.latency_picks += 1;
        }
        self.run_on(id, leaf, now);
        self.rq_changed(leaf, now);
    }

    /// The start itself, shared by [`Sched::set_next`] and the fast start
    /// ([`Sched::start_at_once`]): `id`, out of every wait structure,
    /// joins `leaf`'s running set, and the start is reported.
    fn run_on(&mut self, id: TaskId, leaf: LeafId, now: u64) {
        let Some(t) = self.tasks.get_mut(&id) else {
            return;
        };
        // `count_reweighted(id, leaf, true)`, on the lookup made here
        // (only the tick reads the count, never between a start's steps).
        if t.weight != NICE_0_LOAD {
            self.nr_reweighted[leaf] += 1;
        }
        let rq = &mut self.rqs[leaf];
        rq.running.push(id);
        rq.running_demand += t.demand;
        if let Some(s) = rq.align_free.as_mut() {
            // Conservative until the caller reports the real room again.
            for align in Align::ALL {
                s.set(align, s.get(align).saturating_sub(t.demand));
            }
        }
        t.state = TaskState::Running(leaf);
        t.exec_start = now;
        t.prev_sum_exec_runtime = t.sum_exec_runtime;
        t.recent_used_leaf = t.prev_leaf;
        t.prev_leaf = Some(leaf);
        // A preempted task picked again at once did not really stop.
        if self.events.last() == Some(&SchedEvent::Preempted { task: id, leaf }) {
            self.events.pop();
            self.stats.nr_preemptions -= 1;
        } else {
            self.events.push(SchedEvent::Started { task: id, leaf });
            self.stats.nr_switches += 1;
        }
    }

    /// Put a running task back in the queue (`put_prev_entity`); it goes
    /// back to the latency timeline too if it ran less than
    /// `min_granularity` (seed 004).
    fn put_prev(&mut self, id: TaskId, leaf: LeafId, now: u64) {
        self.update_curr(id, now);
        self.settle(leaf);
        self.count_reweighted(id, leaf, false);
        self.seq += 1;
        let seq = self.seq;
        let latency_enabled = self.config.latency;
        let min_gran = self.config.min_granularity;
        let llc = self.topo.llc_of(leaf);
        let Some(t) = self.tasks.get_mut(&id) else {
            return;
        };
        if let Some(m) = t.prediction_missed_at(now) {
            let slot = &mut self.pred_missed[leaf];
            slot.set(Some(slot.get().map_or(m, |x| x.max(m))));
        }
        let rq = &mut self.rqs[leaf];
        // In `running` once, as above.
        rq.running.remove(id);
        debug_assert!(!rq.running.contains(&id), "task {id:?} ran twice");
        rq.running_demand -= t.demand;
        t.state = TaskState::Queued(leaf);
        t.enqueue_seq = seq;
        t.queued_at = now;
        if rq.enqueue_fair((t.vruntime, seq, id), t.demand, t.is_bounded()) {
            self.nr_waiting += 1;
        }
        self.llc_demands.wait_insert(llc, t.demand);
        self.domains.wait_insert(leaf, t);
        let delta_exec = t.sum_exec_runtime - t.prev_sum_exec_runtime;
        if latency_enabled && t.latency_offset < 0 && delta_exec < min_gran {
            rq.enqueue_latency((t.vruntime + t.latency_offset, seq, id), t.demand);
            self.llc_demands.latency_insert(llc, t.demand);
            t.in_latency_tree = true;
        }
        self.stats.nr_preemptions += 1;
        self.events.push(SchedEvent::Preempted { task: id, leaf });
        self.rq_changed(leaf, now);
    }

    fn resched(&mut self, leaf: LeafId, curr: TaskId, now: u64) {
        if self.tasks.get(&curr).map(|t| t.state) != Some(TaskState::Running(leaf)) {
            return;
        }
        self.put_prev(curr, leaf, now);
        self.schedule(leaf, now);
    }

    /// `sched_slice`: the task's share of the latency period by weight,
    /// scaled by the leaf's capacity.
    fn sched_slice(&self, leaf: LeafId, t: &Task) -> u64 {
        let rq = &self.rqs[leaf];
        let nr_latency = (self.config.sched_latency / self.config.min_granularity.max(1)).max(1);
        let nr = rq.nr_running as u64;
        let period = if nr > nr_latency {
            nr * self.config.min_granularity
        } else {
            self.config.sched_latency
        };
        let load = rq.load_weight.max(t.weight);
        ((period as u128 * t.weight as u128 * rq.capacity.max(1) as u128) / load as u128)
            .min(period as u128) as u64
    }

    /// `check_preempt_tick`: true when the running task's slice is over.
    fn check_preempt_tick(&self, leaf: LeafId, id: TaskId) -> bool {
        let Some(t) = self.tasks.get(&id) else {
            return false;
        };
        let ideal = self.sched_slice(leaf, t);
        let delta_exec = t.sum_exec_runtime - t.prev_sum_exec_runtime;
        if delta_exec > ideal {
            return true;
        }
        if delta_exec < self.config.min_granularity {
            return false;
        }
        match self.rqs[leaf].first_fair() {
            Some(left) => t.vruntime - left.0 > ideal as i64,
            None => false,
        }
    }

    /// `check_preempt_wakeup`: a task queued behind full capacity preempts
    /// the running task furthest ahead in vruntime when
    /// `wakeup_preempt_entity` says so (latency offset included).
    fn check_preempt_wakeup(&mut self, leaf: LeafId, id: TaskId, now: u64) {
        if !self.config.preempt {
            return;
        }
        let demand = match self.tasks.get(&id) {
            Some(t) => t.demand,
            None => return,
        };
        if self.rqs[leaf].free() >= demand {
            return;
        }
        let running = self.rqs[leaf].running.to_vec();
        for &c in &running {
            self.update_curr(c, now);
        }
        let curr = running
            .iter()
            .filter_map(|c| self.tasks.get(c))
            .max_by_key(|t| t.vruntime)
            .map(|t| t.id);
        let Some(curr) = curr else {
            return;
        };
        let (Some(c), Some(p)) = (self.tasks.get(&curr), self.tasks.get(&id)) else {
            return;
        };
        // Preempt only for a task that can then run: with capacities and
        // demands the newcomer may not fit even in the preempted room.
        let room = self.rqs[leaf].free() + c.demand;
        if p.demand <= room && self.wakeup_preempt_entity(c, p) == 1 {
            self.put_prev(curr, leaf, now);
        }
    }

    /// Run what fits (`pick_next_task`); when the leaf is left with room and
    /// nothing to run, it is idle: newidle stealing (seed 000 patch 8).
    /// With backfill, a head that cannot start does not stop the queue:
    /// later tasks that cannot delay its reservation start, and spare
    /// capacity left after that steals.
    pub fn schedule(&mut self, leaf: LeafId, now: u64) {
        self.schedule_after_start(leaf, now, false);
    }

    /// [`Sched::schedule`]; with `in_fifo_pull`, its first pass starts at
    /// `fifo_pull` (the fast start, [`Sched::start_at_once`], began it).
    fn schedule_after_start(&mut self, leaf: LeafId, now: u64, in_fifo_pull: bool) {
        self.schedule_one(leaf, now, in_fifo_pull);
        // Leaves that lost their domain's reservation meanwhile may start
        // what their head no longer holds back.
        while let Some(x) = self.domains.deferred.pop() {
            self.schedule_one(x, now, false);
        }
    }

    /// [`Sched::schedule_one`] when nothing waits anywhere and no leaf is
    /// overloaded: the steal attempt of a leaf with room, which steals
    /// nothing and only counts its gates in schedstats.
    #[inline]
    fn steal_gates_only(&mut self, leaf: LeafId, now: u64) {
        let rq = &self.rqs[leaf];
        let steals = if self.config.backfill {
            rq.has_spare()
        } else {
            rq.is_idle()
        };
        if steals {
            let stolen = self.try_steal(leaf, now);
            debug_assert!(stolen.is_none(), "a steal with nothing waiting");
        }
    }

    fn schedule_one(&mut self, leaf: LeafId, now: u64, in_fifo_pull: bool) {
        // Nothing waits anywhere and no leaf is overloaded: the latency
        // pull returns at once (its shortcut), the domain queue has no task
        // to find, the leaf has none to start or backfill, and the steal
        // search finds nothing; what is left is the steal attempt's gates,
        // which count in schedstats, reached as the loop below reaches it.
        if self.nr_waiting == 0 && self.overload.total() == 0 && self.shortcuts() {
            self.steal_gates_only(leaf, now);
            return;
        }
        let mut stolen = None;
        let mut skip_latency_pull = in_fifo_pull;
        loop {
            // Latency-sensitive tasks waiting in the domain first
            // (`SchedConfig::latency_pull`, off unless configured).
            if !std::mem::take(&mut skip_latency_pull) {
                self.latency_pull(leaf, now);
            }
            // The domain's oldest waiting tasks first
            // (`SchedConfig::domain_fifo`, off unless configured).
            self.fifo_pull(leaf, now);
            while let Some(next) = self.next_startable(leaf) {
                let Some((demand, align)) = self.tasks.get(&next).map(|t| (t.demand, t.align))
                else {
                    break;
                };
                if !self.rqs[leaf].can_start(demand, align) {
                    break;
                }
                self.set_next(next, leaf, now);
                self.latency_pull(leaf, now);
            }
            if self.config.backfill {
                self.backfill(leaf, now);
                if !self.rqs[leaf].has_spare() {
                    return;
                }
            } else if !self.rqs[leaf].is_idle() || !self.rqs[leaf].nothing_waits() {
                return;
            }
            // A task is stolen only if it can start here now; should it
            // not have started (its arrival changed which task is the
            // head), stop rather than keep pulling.
            if let Some(p) = stolen
                && !matches!(
                    self.tasks.get(&p).map(|t| t.state),
                    Some(TaskState::Running(_))
                )
            {
                return;
            }
            stolen = self.try_steal(leaf, now);
            if stolen.is_none() {
                return;
            }
        }
    }

    // ----- EASY backfill -----

    /// The reservation of `leaf`'s head at `now` (EASY backfill): the head
    /// is the first waiting task in next-to-run order that fits the leaf's
    /// capacity at all; `None` when there is none. Computed whether or not
    /// backfill is on (the dispatcher can report it as a pending reason).
    ///
    /// Run-time predictions ([`crate::TaskSpec::predicted`], EASY++): a
    /// running task's expected end is its prediction in force when that
    /// is shorter than its limit or it has no limit ([`Task::estimate`]:
    /// a prediction it outlives is doubled), and a task may be backfilled
    /// on its own prediction ([`Reservation::predicted`]) — but only while
    /// no prediction on the leaf has failed since the head began to wait
    /// (no task running there, or that ran there, passed a prediction
    /// that governed its estimate after the head's `queued_at`). From the
    /// first such failure the leaf counts on limits only, as without
    /// predictions, until the head starts. So the head's wait keeps a
    /// bound: while every prediction holds, each running and backfilled
    /// task ends by its expected end and the head starts by its start (as
    /// EASY with limits); once one fails, no task starts past the head on
    /// a prediction any more, and the head waits at most for the tasks
    /// already running (the bound without predictions). A wrong
    /// prediction delays the head once, not forever.
    pub fn reservation(&self, leaf: LeafId, now: u64) -> Option<Reservation> {
        let head = self.next_startable(leaf)?;
        let h = self.tasks.get(&head)?;
        let (start, extra, predicted) = self.shadow(leaf, h.demand, h.queued_at, now);
        Some(Reservation {
            task: head,
            start,
            extra,
            predicted,
        })
    }

    /// True when no prediction on `leaf` has failed at or after `since`
    /// (the head's `queued_at`), judged at `at`: no task running there, or
    /// that ran there, passed a prediction that governed its estimate since.
    fn predictions_hold(&self, leaf: LeafId, since: u64, at: u64) -> bool {
        if self.pred_missed[leaf].get().is_some_and(|m| m >= since) {
            return false;
        }
        !self.rqs[leaf].running.iter().any(|id| {
            self.tasks
                .get(id)
                .and_then(|t| t.prediction_missed_at(at))
                .is_some_and(|m| m >= since)
        })
    }

    /// The shadow time and extra capacity for a head of `demand` that has
    /// waited since `since` on `leaf`: walk the running tasks by expected
    /// end, freeing their demand, until the head fits; every task ending
    /// at that instant has ended by it. The third value says whether the
    /// ends counted on predictions ([`Sched::reservation`]).
    fn shadow(&self, leaf: LeafId, demand: u32, since: u64, now: u64) -> (Option<u64>, u32, bool) {
        let rq = &self.rqs[leaf];
        let mut avail = rq.free();
        if avail >= demand {
            return (Some(now), avail - demand, false);
        }
        // A deferred tick later than `now` has accounted up to its time.
        let accounted = self.tick_pending[leaf].get().unwrap_or(now);
        let predicted = self.predictions_hold(leaf, since, now.max(accounted));
        let mut ends: Vec<(Option<u64>, u32)> = rq
            .running
            .iter()
            .filter_map(|id| self.tasks.get(id))
            .map(|t| {
                (
                    t.expected_end_accounted(now, accounted, predicted),
                    t.demand,
                )
            })
            .collect();
        // Known ends ascending, unknown (never) last.
        ends.sort_unstable_by_key(|&(end, _)| (end.is_none(), end));
        let mut i = 0;
        while let Some(&(Some(end), _)) = ends.get(i) {
            while let Some(&(e, d)) = ends.get(i) {
                if e != Some(end) {
                    break;
                }
                avail += d;
                i += 1;
            }
            if avail >= demand {
                return (Some(end), avail - demand, predicted);
            }
        }
        (None, 0, predicted)
    }

    /// True when task `t` may start on `leaf` now without delaying the
    /// reservation `res` of the leaf's head: it fits now, and it either
    /// uses only the extra capacity or ends by the shadow time (by its
    /// limit, or its prediction when `res.predicted`). A task with neither
    /// never ends by a known time; a reservation without a known time (it
    /// waits on a task without either) is delayed by no task that has one.
    pub(crate) fn backfill_ok(&self, leaf: LeafId, res: &Reservation, t: &Task, now: u64) -> bool {
        if !self.rqs[leaf].can_start(t.demand, t.align) {
            return false;
        }
        if t.demand <= res.extra {
            return true;
        }
        match (res.start, t.expected_end_accounted(now, now, res.predicted)) {
            (_, None) => false,
            (None, Some(_)) => true,
            (Some(shadow), Some(end)) => end <= shadow,
        }
    }

    /// EASY backfill of one leaf: while the head cannot start, start the
    /// first waiting task, in next-to-run order, that cannot delay the
    /// head's reservation (recomputed after each start).
    ///
    /// A leaf whose head is not its domain's protected one
    /// (`SchedConfig::domain_reservation`) starts any waiting task that
    /// fits now.
    fn backfill(&mut self, leaf: LeafId, now: u64) {
        loop {
            // Every candidate must be able to start now (`backfill_ok` and
            // the unprotected test both need `can_start`): when no waiting
            // demand is within the leaf's start bound, there is none, and
            // neither the reservation nor a walk of the queue is needed.
            let rq = &self.rqs[leaf];
            if !rq.wait_demands().any_within(rq.start_bound()) {
                return;
            }
            let res = if self.protected(leaf) {
                self.reservation(leaf, now)
            } else {
                self.next_to_run(leaf).map(|task| Reservation {
                    task,
                    start: None,
                    extra: 0,
                    predicted: false,
                })
            };
            let Some(res) = res else {
                return;
            };
            let protected = self.protected(leaf);
            let candidate = |c: TaskId| {
                c != res.task
                    && self.tasks.get(&c).is_some_and(|t| {
                        if protected {
                            self.backfill_ok(leaf, &res, t, now)
                        } else {
                            self.rqs[leaf].can_start(t.demand, t.align)
                        }
                    })
            };
            let rq = &self.rqs[leaf];
            let found = if protected
                && !rq
                    .wait_demands()
                    .any_within(res.extra.min(rq.start_bound()))
            {
                // No waiting task fits the extra room now, so a candidate
                // needs an expected end (`backfill_ok`): a time limit or a
                // prediction. The first such in next-to-run order is the
                // first of the latency pick (when it is one) and the
                // bounded tasks in fair order; with thousands waiting
                // without a limit behind a blocked head, the whole queue
                // was walked on every finish.
                debug_assert!(self.bounded_timeline_holds(leaf));
                first_then_fair(self.pick_next_entity(leaf), rq.waiting_bounded())
                    .find(|&c| candidate(c))
            } else {
                self.next_to_run_order(leaf).find(|&c| candidate(c))
            };
            match found {
                Some(c) => self.set_next(c, leaf, now),
                None => return,
            }
        }
    }

    /// True when task `id` (waiting elsewhere, or new) could start on
    /// `leaf` now: it fits the room for newcomers, or with backfill, it
    /// fits now without delaying the leaf's head.
    pub fn fits_now(&self, leaf: LeafId, id: TaskId, now: u64) -> bool {
        let Some(t) = self.tasks.get(&id) else {
            return false;
        };
        let rq = &self.rqs[leaf];
        if !self.config.backfill || rq.nothing_waits() {
            return t.demand <= rq.room(t.align);
        }
        // Every answer below needs room now: a task that cannot start
        // here now is refused before the reservation is computed (a
        // steal search asks this of every waiting task it visits).
        if !rq.can_start(t.demand, t.align) || !self.protected(leaf) {
            return rq.can_start(t.demand, t.align);
        }
        match self.reservation(leaf, now) {
            Some(res) if res.task != id => self.backfill_ok(leaf, &res, t, now),
            _ => rq.can_start(t.demand, t.align),
        }
    }

    /// `leaf`'s `bounded_timeline` holds exactly its waiting tasks with a
    /// limit or a prediction, in fair order (checked in debug builds
    /// where the walks rely on it).
    pub(crate) fn bounded_timeline_holds(&self, leaf: LeafId) -> bool {
        let rq = &self.rqs[leaf];
        rq.waiting()
            .filter(|id| self.tasks.get(id).is_some_and(|t| t.is_bounded()))
            .eq(rq.waiting_bounded())
    }

    /// The extra room of `leaf`'s protected head when [`Sched::fits_now`]
    /// decides by it (backfill on, a head waiting there with its
    /// reservation): a task from elsewhere fits only if it can start now
    /// and either needs no more than this or ends in time
    /// ([`Sched::backfill_ok`]). `None` when `fits_now` asks only for
    /// room.
    pub(crate) fn backfill_extra(&self, leaf: LeafId, now: u64) -> Option<u32> {
        if !self.config.backfill || self.rqs[leaf].nothing_waits() || !self.protected(leaf) {
            return None;
        }
        self.reservation(leaf, now).map(|res| res.extra)
    }

    /// The leaf may take work from others now: idle, or with backfill any
    /// spare capacity (whether a task fits is decided per task).
    pub(crate) fn can_pull(&self, leaf: LeafId) -> bool {
        if self.config.backfill {
            self.rqs[leaf].has_spare()
        } else {
            self.rqs[leaf].is_idle()
        }
    }

    /// Overloaded: more runnable demand than capacity (the kernel's
    /// definition for `C = 1`); with backfill also any waiting work,
    /// which after `schedule` is work that cannot start now.
    pub(crate) fn leaf_overloaded(&self, leaf: LeafId) -> bool {
        let rq = &self.rqs[leaf];
        rq.is_overloaded() || (self.config.backfill && !rq.nothing_waits())
    }

    /// Called after every change of a leaf's queue: keeps the overload mask
    /// (exactly on transitions), the busy flags (idle at once), the idle
    /// stamp, the aggregates and the packing index in step.
    pub(crate) fn rq_changed(&mut self, leaf: LeafId, now: u64) {
        self.last_now = self.last_now.max(now);
        let moved = self.update_head_key(leaf);
        self.refresh_leaf(leaf, now);
        // The domain's reservation moved (`SchedConfig::domain_reservation`):
        // the leaf that gained it has less room for newcomers at once; the
        // one that lost it has more, and may start what its head held back.
        if let Some((before, after)) = moved {
            for x in [before, after].into_iter().flatten() {
                if x != leaf {
                    self.refresh_leaf(x, now);
                }
            }
            if let Some(b) = before
                && b != leaf
            {
                self.domains.deferred.push(b);
            }
        }
    }

    /// The part of [`Sched::rq_changed`] that reads the leaf's head but
    /// does not change it: room, overload bit, idle state, aggregates.
    fn refresh_leaf(&mut self, leaf: LeafId, now: u64) {
        let backfill_room = if self.config.backfill && !self.rqs[leaf].nothing_waits() {
            Some(if self.protected(leaf) {
                match self.reservation(leaf, now) {
                    Some(res) => res.extra,
                    None => self.rqs[leaf].free(),
                }
            } else {
                self.rqs[leaf].free()
            })
        } else {
            None
        };
        let overloaded = self.leaf_overloaded(leaf);
        let rq = &mut self.rqs[leaf];
        rq.set_backfill_room(backfill_room);
        if overloaded != rq.overloaded {
            rq.overloaded = overloaded;
            if overloaded {
                self.overload.overload_set(&self.topo, leaf);
            } else {
                self.overload.overload_clear(&self.topo, leaf);
            }
        }
        let rq = &mut self.rqs[leaf];
        let idle = rq.is_idle();
        if idle {
            if rq.idle_stamp.get().is_none() {
                rq.idle_stamp.set(Some(now));
            }
        } else {
            rq.idle_stamp = OptTime::NONE;
        }
        let ticking = !idle || !rq.is_empty();
        // Idle: the flags above are cleared at once (`mark_idle`).
        self.busy.set_leaf(&self.topo, leaf, !idle);
        // Empty and idle: its tick stops (NO_HZ idle); work restarts it.
        self.nohz.set(leaf, ticking);
        if !self.agg_defer {
            self.refresh_aggregates(leaf);
        } else if !self.agg_dirty[leaf] {
            self.agg_dirty[leaf] = true;
            self.agg_pending.push(leaf);
        }
    }

    /// Run one operation with the aggregates' refresh deferred to its end
    /// (`agg_defer`): a placement enqueues and starts a task, a removal
    /// dequeues one and starts the next, each a change of the same leaf;
    /// its aggregates and those above it are refreshed once. Nested
    /// calls refresh at the outermost end.
    pub(crate) fn coalesced<R>(&mut self, f: impl FnOnce(&mut Self) -> R) -> R {
        let outer = self.defer_aggregates();
        let r = f(self);
        self.settle_aggregates(outer);
        r
    }

    /// Defer the aggregates' refresh over several operations, as
    /// [`Sched::coalesced`] does inside one: a caller whose placement is
    /// followed by a room report of the same leaf (the dispatcher: the
    /// start's claimed CPUs) refreshes that leaf once. Every reader that
    /// can take `&mut self` flushes first (`select_task_rq_placed`,
    /// `select_task_rq_outer`, `find_idlest`, `find_idlest_from`); the
    /// `&self` readers (`aggregate`, `llc_free`, `pack_active`) need [`Sched::flush_aggregates`] first (a debug
    /// assertion checks). Returns whether a deferral was already open;
    /// pass it to [`Sched::settle_aggregates`].
    pub fn defer_aggregates(&mut self) -> bool {
        std::mem::replace(&mut self.agg_defer, true)
    }

    /// End a deferral ([`Sched::defer_aggregates`]): unless an outer one
    /// is open (`outer`), refresh every changed leaf's aggregates.
    pub fn settle_aggregates(&mut self, outer: bool) {
        if !outer {
            self.agg_defer = false;
            self.flush_aggregates();
        }
    }

    /// Refresh the aggregates of the leaves changed since they were last
    /// refreshed (a deferral stays open).
    pub fn flush_aggregates(&mut self) {
        while let Some(leaf) = self.agg_pending.pop() {
            self.agg_dirty[leaf] = false;
            self.refresh_aggregates(leaf);
        }
    }

    fn refresh_aggregates(&mut self, leaf: LeafId) {
        let rq = &self.rqs[leaf];
        let leaf_new = LeafAgg {
            capacity: rq.capacity,
            nr_running: rq.nr_running,
            free: rq.fit_free(),
            max_room: rq.rooms(),
        };
        let leaf_old = std::mem::replace(&mut self.leaf_agg[leaf], leaf_new);
        let (mut old, mut new) = (NodeAgg::from(leaf_old), NodeAgg::from(leaf_new));
        // Read back by pack placements only (`Sched::pack_target`).
        self.pack.mark(leaf);
        // One child changed from `old` to `new`: the parent's sums move by
        // the difference, its maxima are read from the index over its
        // children (`IdlestIndex`, O(log fanout)), not recounted.
        let mut child = leaf;
        while old != new {
            let Some((max_room, max_free)) = self.idlest.update(child, &new) else {
                break;
            };
            let Some(d) = self.topo.node(child).parent() else {
                break;
            };
            let prev = self.dom_agg[d - self.leaf_agg.len()];
            let a = NodeAgg {
                capacity: prev.capacity - old.capacity + new.capacity,
                nr_running: prev.nr_running - old.nr_running + new.nr_running,
                sum_free: prev.sum_free - old.sum_free + new.sum_free,
                max_free,
                max_room,
            };
            self.dom_agg[d - self.leaf_agg.len()] = a;
            (old, new, child) = (prev, a, d);
        }
    }
}

/// `update_curr`'s accounting of one task: the execution since
/// `exec_start`, in real and virtual time. Returns its leaf when it ran
/// (None when not running or no time passed).
fn account_task(t: &mut Task, now: u64) -> Option<LeafId> {
    let TaskState::Running(leaf) = t.state else {
        return None;
    };
    let delta = now.saturating_sub(t.exec_start);
    if delta == 0 {
        return None;
    }
    t.exec_start = now;
    t.sum_exec_runtime += delta;
    t.vruntime += calc_delta_fair(delta, t.weight) as i64;
    Some(leaf)
}

/// Node-limit gating (seed 000 patch 9): whether stealing inside an LLC is
/// allowed, and per LLC whether stealing from its sibling LLCs is.
fn steal_gating(topo: &Topology, config: &SchedConfig) -> (bool, Vec<bool>) {
    let limit = config.steal_node_limit;
    match config.node_limit_scope {
        NodeLimitScope::Global => {
            let ok = topo.nr_numa() <= limit;
            (ok, vec![ok; topo.llcs().len()])
        }
        NodeLimitScope::Domain => {
            // One span per parent domain, not per LLC: in a cluster's
            // engine the LLCs are racks and their parent a zone, and each
            // span collects and sorts the NUMA ids of every node under it
            // (250 racks of a 10,000-node cluster made 250 such 20 KB
            // vectors, ~2,500 ids each, at every rebuild).
            let mut span_ok: IdMap<NodeId, bool> = IdMap::default();
            let cross = topo
                .llcs()
                .iter()
                .map(|llc| match topo.node(llc.node).parent() {
                    Some(p) => *span_ok
                        .entry(p)
                        .or_insert_with(|| topo.numa_span(p) <= limit),
                    None => true,
                })
                .collect();
            (true, cross)
        }
    }
}

/// Next-to-run order over one of a leaf's timelines: `first` (the leaf's
/// `pick_next_entity`, which is `None` only when nothing waits), then
/// `fair` (all the waiting tasks, or the bounded ones, in fair order)
/// without it.
fn first_then_fair(
    first: Option<TaskId>,
    fair: impl Iterator<Item = TaskId>,
) -> impl Iterator<Item = TaskId> {
    first
        .into_iter()
        .chain(fair.filter(move |&x| Some(x) != first))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SchedConfig;
    use crate::topology::DomainFlags;

    fn engine(spec: &str) -> Sched {
        Sched::new(
            Arc::new(Topology::from_spec(spec).unwrap()),
            1,
            SchedConfig::default(),
        )
    }

    /// The cluster form of node-limit gating computes one NUMA span per
    /// parent domain and answers, for every LLC, what the span of that
    /// LLC's own parent gives (the oracle: each LLC's parent measured
    /// again).
    #[test]
    fn domain_gating_is_each_llcs_parent_span() {
        // Racks that are NUMA nodes of their own, under pods of two and
        // of three racks: the two pods' spans differ (2 and 3).
        let pods = || {
            let rack: Vec<u64> = vec![0, 0, 1, 1, 2, 2, 3, 3, 4, 4];
            crate::topology::TopologyBuilder::new((0..10).collect())
                .level("rack", DomainFlags::LLC, rack.clone())
                .level("zone", DomainFlags::NUMA, rack)
                .level("pod", DomainFlags::NONE, vec![0, 0, 0, 0, 1, 1, 1, 1, 1, 1])
                .build()
                .unwrap()
        };
        let uneven = pods();
        let spans: Vec<usize> = uneven
            .llcs()
            .iter()
            .map(|llc| uneven.numa_span(uneven.node(llc.node).parent().unwrap()))
            .collect();
        assert_eq!(spans, [2, 2, 3, 3, 3]);
        for (spec, topo) in [
            ("pods of 2 and 3 racks", pods()),
            ("2z:4r:8n", Topology::from_spec("2z:4r:8n").unwrap()),
            ("3z:2r:4n:2h", Topology::from_spec("3z:2r:4n:2h").unwrap()),
            (
                "2s:8c:2t:llc=2:numa=2",
                Topology::from_spec("2s:8c:2t:llc=2:numa=2").unwrap(),
            ),
        ] {
            for limit in 0..4 {
                let config = SchedConfig {
                    steal_node_limit: limit,
                    node_limit_scope: NodeLimitScope::Domain,
                    ..SchedConfig::default()
                };
                let (llc_ok, cross) = steal_gating(&topo, &config);
                let oracle: Vec<bool> = topo
                    .llcs()
                    .iter()
                    .map(|llc| {
                        topo.node(llc.node)
                            .parent()
                            .is_none_or(|p| topo.numa_span(p) <= limit)
                    })
                    .collect();
                assert!(llc_ok, "{spec}");
                assert_eq!(cross, oracle, "{spec} limit {limit}");
            }
        }
    }

    /// A leaf's aggregate stays in 32 bytes (a cluster's engine has one
    /// per node), and reads back as the `NodeAgg` it stands for.
    #[test]
    fn a_leaf_aggregate_is_32_bytes() {
        assert_eq!(std::mem::size_of::<LeafAgg>(), 32);
        let a = LeafAgg {
            capacity: u32::MAX,
            nr_running: 7,
            free: 5,
            max_room: [1, 2, 3, 4, 5],
        };
        assert_eq!(
            NodeAgg::from(a),
            NodeAgg {
                capacity: u32::MAX as u64,
                nr_running: 7,
                sum_free: 5,
                max_free: 5,
                max_room: [1, 2, 3, 4, 5],
            }
        );
    }

    /// A finish's single `update_min_vruntime` ([`Sched::block`]): a task
    /// started and removed at the same instant (nothing accounted), last
    /// on its leaf, with a vruntime above the leaf's `min_vruntime` (it
    /// ran elsewhere) leaves `min_vruntime` as the full path does: not
    /// raised to the task's vruntime.
    #[test]
    fn a_finish_that_accounted_nothing_leaves_min_vruntime() {
        let run = |shortcuts: bool| {
            let mut s = engine("1s:2c:1t");
            s.set_shortcuts(shortcuts);
            for i in 0..2 {
                s.add_task(TaskSpec::new(TaskId(i))).unwrap();
            }
            s.wake_up_on(TaskId(0), 0, 0).unwrap();
            s.wake_up_on(TaskId(1), 0, 0).unwrap();
            // Task 0 runs 10 ms, task 1 waits behind it at vruntime 0.
            s.block(TaskId(0), 10_000_000).unwrap();
            assert_eq!(s.min_vruntime(0), 0);
            s.wake_up_on(TaskId(0), 1, 10_000_000).unwrap();
            assert_eq!(s.task(TaskId(0)).unwrap().vruntime, 10_000_000);
            s.remove_task(TaskId(0), 10_000_000).unwrap();
            s.min_vruntime(1)
        };
        assert_eq!(run(false), 0);
        assert_eq!(run(true), run(false));
    }

    #[test]
    fn wake_runs_then_queues_and_overloads() {
        let mut s = Sched::new(
            Arc::new(Topology::from_spec("1s:1c:1t").unwrap()),
            1,
            SchedConfig::default(),
        );
        for i in 0..3 {
            s.add_task(TaskSpec::new(TaskId(i))).unwrap();
        }
        assert_eq!(s.wake_up(TaskId(0), None, false, 0).unwrap(), 0);
        assert_eq!(s.task(TaskId(0)).unwrap().state, TaskState::Running(0));
        assert!(!s.overload_masks().test(s.topology(), 0));
        s.wake_up(TaskId(1), None, false, 10).unwrap();
        assert!(s.rq(0).is_overloaded());
        assert!(s.overload_masks().test(s.topology(), 0));
        s.block(TaskId(0), 20).unwrap();
        assert_eq!(s.task(TaskId(1)).unwrap().state, TaskState::Running(0));
        assert!(!s.overload_masks().test(s.topology(), 0));
        let ev = s.drain_events();
        assert_eq!(
            ev.first(),
            Some(&SchedEvent::Started {
                task: TaskId(0),
                leaf: 0
            })
        );
    }

    #[test]
    fn bad_input_is_an_error() {
        let mut s = engine("1s:2c:1t");
        let mut spec = TaskSpec::new(TaskId(1));
        spec.nice = 40;
        assert!(matches!(
            s.add_task(spec),
            Err(SchedError::BadNice { field: "nice", .. })
        ));
        let mut spec = TaskSpec::new(TaskId(1));
        spec.demand = 0;
        assert_eq!(s.add_task(spec), Err(SchedError::ZeroDemand));
        s.add_task(TaskSpec::new(TaskId(1))).unwrap();
        assert_eq!(
            s.add_task(TaskSpec::new(TaskId(1))),
            Err(SchedError::DuplicateTask(TaskId(1)))
        );
        assert!(matches!(
            s.wake_up_on(TaskId(1), 9, 0),
            Err(SchedError::BadLeaf { .. })
        ));
        assert_eq!(
            s.wake_up(TaskId(7), None, false, 0),
            Err(SchedError::UnknownTask(TaskId(7)))
        );
        s.wake_up(TaskId(1), None, false, 0).unwrap();
        assert_eq!(
            s.wake_up(TaskId(1), None, false, 0),
            Err(SchedError::AlreadyRunnable(TaskId(1)))
        );
    }

    #[test]
    fn tick_time_slices_two_tasks() {
        let mut s = Sched::new(
            Arc::new(Topology::from_spec("1s:1c:1t").unwrap()),
            1,
            SchedConfig::default(),
        );
        for i in 0..2 {
            s.add_task(TaskSpec::new(TaskId(i))).unwrap();
            s.wake_up_on(TaskId(i), 0, 0).unwrap();
        }
        let mut now = 0;
        for _ in 0..1000 {
            now += 1_000_000;
            s.tick(0, now);
        }
        let a = s.task(TaskId(0)).unwrap().sum_exec_runtime as f64;
        let b = s.task(TaskId(1)).unwrap().sum_exec_runtime as f64;
        assert!((a / b - 1.0).abs() < 0.02, "{a} vs {b}");
    }

    #[test]
    fn removing_a_queued_head_runs_what_fits_behind_it() {
        let mut s = Sched::new(
            Arc::new(Topology::from_spec("1z:1r:2n").unwrap()),
            8,
            SchedConfig::cluster(),
        );
        for (id, demand) in [(1, 6), (2, 4), (3, 2)] {
            let mut spec = TaskSpec::new(TaskId(id));
            spec.demand = demand;
            s.add_task(spec).unwrap();
            s.wake_up_on(TaskId(id), 0, id).unwrap();
        }
        assert_eq!(s.task(TaskId(3)).unwrap().state, TaskState::Queued(0));
        s.block(TaskId(2), 4).unwrap();
        assert_eq!(s.task(TaskId(3)).unwrap().state, TaskState::Running(0));
    }

    /// Seed 004: positive latency-nice accepts more scheduling delay, so
    /// a waking task with latency-nice 19 preempts later than one at 0
    /// (the old `offset.min(0)` threw the positive offset away).
    #[test]
    fn positive_latency_nice_preempts_later() {
        let s = engine("1s:1c:1t");
        let mk = |id: u64, latency_nice: i32, vruntime: i64| {
            let mut spec = TaskSpec::new(TaskId(id));
            spec.latency_nice = latency_nice;
            let mut t = Task::new(spec, crate::config::Policy::Spread, s.config.sched_latency);
            t.vruntime = vruntime;
            t
        };
        let gran = s.config.wakeup_granularity as i64;
        let curr = mk(1, 0, 10 * gran);
        // 1.5 granularities behind curr: preempts at latency-nice 0 ...
        let plain = mk(2, 0, 10 * gran - 3 * gran / 2);
        assert_eq!(s.wakeup_preempt_entity(&curr, &plain), 1);
        // ... but not at latency-nice 19, whose offset (capped at one
        // granularity) is subtracted from the lead.
        let relaxed = mk(3, 19, 10 * gran - 3 * gran / 2);
        assert_eq!(s.wakeup_preempt_entity(&curr, &relaxed), 0);
        // With latency-nice off the offset is ignored.
        let mut off = engine("1s:1c:1t");
        off.config.latency = false;
        assert_eq!(off.wakeup_preempt_entity(&curr, &relaxed), 1);
    }

    /// A fair-timeline head `left` and a latency-sensitive task `lat`
    /// whose vruntime is `lead` ns ahead of `left`, both waiting on leaf 0
    /// of a one-leaf, non-preempting engine. Returns the engine.
    fn latency_vs_fair(lead: i64) -> Sched {
        let mut s = Sched::new(
            Arc::new(Topology::from_spec("1s:1c:1t").unwrap()),
            1,
            SchedConfig {
                preempt: false,
                ..SchedConfig::default()
            },
        );
        let mut lat = TaskSpec::new(TaskId(3));
        lat.latency_nice = -20;
        for spec in [TaskSpec::new(TaskId(1)), TaskSpec::new(TaskId(2)), lat] {
            s.add_task(spec).unwrap();
        }
        s.wake_up_on(TaskId(1), 0, 0).unwrap();
        s.wake_up_on(TaskId(2), 0, 0).unwrap();
        // Task 3 has run before, further ahead in virtual time.
        let t = s.tasks.get_mut(&TaskId(3)).unwrap();
        t.sum_exec_runtime = 1;
        t.vruntime = lead;
        s.wake_up_on(TaskId(3), 0, 0).unwrap();
        s
    }

    /// Seed 004: `pick_next_entity` runs the latency task first when
    /// `wakeup_preempt_entity(latency, left) < 1`, its offset included.
    /// 1.5 granularities ahead it still goes first (the old clamp lost the
    /// offset here and picked the fair head); 3 granularities ahead, past
    /// the capped offset plus a granularity, fairness wins.
    #[test]
    fn pick_next_entity_honours_the_latency_offset() {
        let gran = SchedConfig::default().wakeup_granularity as i64;
        let s = latency_vs_fair(3 * gran / 2);
        assert_eq!(s.task(TaskId(1)).unwrap().state, TaskState::Running(0));
        assert_eq!(s.next_to_run(0), Some(TaskId(3)));
        let s = latency_vs_fair(3 * gran);
        assert_eq!(s.next_to_run(0), Some(TaskId(2)));
    }

    /// Seed 004: a latency-sensitive task that is stolen keeps its place
    /// in the latency timeline on the destination.
    #[test]
    fn migrated_task_stays_in_the_latency_timeline() {
        let mut s = Sched::new(
            Arc::new(Topology::from_spec("1s:2c:1t").unwrap()),
            1,
            SchedConfig {
                preempt: false,
                steal: false,
                ..SchedConfig::default()
            },
        );
        let mut lat = TaskSpec::new(TaskId(3));
        lat.latency_nice = -20;
        for spec in [
            TaskSpec::new(TaskId(0)),
            TaskSpec::new(TaskId(1)),
            TaskSpec::new(TaskId(2)),
            lat,
        ] {
            s.add_task(spec).unwrap();
        }
        s.wake_up_on(TaskId(0), 0, 0).unwrap();
        s.wake_up_on(TaskId(1), 1, 0).unwrap();
        s.wake_up_on(TaskId(2), 1, 0).unwrap();
        s.wake_up_on(TaskId(3), 0, 0).unwrap();
        assert_eq!(s.task(TaskId(3)).unwrap().state, TaskState::Queued(0));
        s.migrate_queued(TaskId(3), 0, 1, 1);
        assert_eq!(s.task(TaskId(3)).unwrap().state, TaskState::Queued(1));
        // Behind task 2 in fair order, first by the latency timeline.
        assert_eq!(s.rq(1).waiting().next(), Some(TaskId(2)));
        assert_eq!(s.next_to_run(1), Some(TaskId(3)));
    }

    #[test]
    fn capacity_and_demand() {
        let mut s = Sched::new(
            Arc::new(Topology::from_spec("1z:1r:1n").unwrap()),
            8,
            SchedConfig::cluster(),
        );
        let mut big = TaskSpec::new(TaskId(1));
        big.demand = 6;
        s.add_task(big).unwrap();
        let mut big2 = TaskSpec::new(TaskId(2));
        big2.demand = 4;
        s.add_task(big2).unwrap();
        s.wake_up_on(TaskId(1), 0, 0).unwrap();
        s.wake_up_on(TaskId(2), 0, 0).unwrap();
        assert_eq!(s.rq(0).running_demand, 6);
        assert!(s.rq(0).is_overloaded());
        s.set_capacity(0, 12, 1).unwrap();
        assert_eq!(s.rq(0).running_demand, 10);
        assert!(!s.rq(0).is_overloaded());
        s.set_capacity(0, 5, 2).unwrap();
        assert!(s.rq(0).running_demand <= 5);
        assert!(s.rq(0).is_overloaded());
    }
}
