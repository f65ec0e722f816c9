//! The discrete-event harness: drives a [`Sched`] with simulated time and a
//! [`Workload`] of task state machines, and measures what the scheduler did.
//!
//! This module owns the event loop ([`Harness`]): the simulated clock, a
//! binary heap of timed events (ties broken by a sequence number, so a run
//! is a pure function of its inputs), the periodic per-leaf tick, the
//! bookkeeping of which task runs where (read from
//! [`Sched::drain_events`]), the modelled costs ([`Costs`]) and the
//! measurements ([`RunStats`]). The experiments live in submodules:
//! [`hackbench`] (seed 000), [`wakeaffine`] (seed 001), [`latency`]
//! (seed 004: a latency class beside hackbench), with [`pipe`] (the
//! bounded message channel both use), [`rng`] (the seeded PRNG) and
//! [`report`] (tables in the seeds' columns) and [`queue`] (the timed event
//! queue and loop, generic over the event type, shared with the cluster
//! simulator).
//!
//! # Model
//!
//! A task is a state machine ([`Workload::step`]). Whenever a task is on a
//! CPU with no work left, the harness asks it for its next [`Step`]: burn
//! CPU for a burst ([`Step::Run`]), block until another task wakes it
//! ([`Step::Block`]), sleep for a time ([`Step::Sleep`]) or exit
//! ([`Step::Exit`]). During a step it may wake other tasks
//! ([`StepCx::wake`]); wakes are issued while the waker still runs, before
//! it blocks, as `try_to_wake_up` is called from inside the waker's
//! syscall. A step's effect (a message written or read) happens at the
//! start of its burst; the burst is the CPU cost of the syscall.
//!
//! A burst completes at `start + remaining`; a preempted task keeps its
//! remaining work and continues when it is started again. Stale
//! completions (the task was preempted meanwhile) are recognised by a
//! per-task epoch number and dropped.
//!
//! Ticks: every leaf with runnable tasks gets `Sched::tick` every
//! `tick_ns` on a global grid (HZ = 250 by default); idle leaves do not
//! tick (NOHZ idle), so a large idle cluster costs no events.
//!
//! Costs ([`Costs`]) come from the machine, never from the configuration
//! under test: a context switch, a cache refill after moving to another
//! LLC, and a cross-LLC wakeup are charged as extra CPU time of the task
//! when it next starts. Moves within an LLC are free: the LLC keeps the
//! task's data warm (seed 000: stealing stays inside the LLC for that
//! reason).
//!
//! # Cost of a run
//!
//! Each event is O(log events) in the heap plus the engine call it makes;
//! per-task state is a dense vector indexed by task id, per-leaf state a
//! dense vector indexed by leaf, so the loop scales with the number of
//! events, not with the number of leaves or tasks.

pub mod hackbench;
pub mod latency;
pub mod pipe;
pub mod queue;
pub mod report;
pub mod rng;
pub mod wakeaffine;

use crate::sched::{Sched, SchedError, SchedEvent};
use crate::stats::Schedstats;
use crate::task::{TaskId, TaskSpec};
use crate::topology::LeafId;

pub use queue::{EventQueue, drive};
pub use rng::Rng;

/// Nanoseconds in a second.
pub const NSEC_PER_SEC: u64 = 1_000_000_000;

/// The tick period at HZ = 250: 4 ms.
pub const TICK_NS_HZ250: u64 = 4_000_000;

/// The modelled costs of the machine, in nanoseconds. The same values are
/// used for every configuration under comparison; each one stands for a
/// real cost, named below, so that differences between configurations come
/// from scheduling decisions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Costs {
    /// CPU time of writing one small message (a 100-byte pipe write,
    /// including the `try_to_wake_up` it may make): ~2 us on a 2.2 GHz
    /// Xeon. Used by workloads, not by the harness itself.
    pub send_ns: u64,
    /// CPU time of reading one small message (a 100-byte pipe read): ~2 us.
    /// Used by workloads.
    pub recv_ns: u64,
    /// Charged to a task each time it is started on a leaf: the context
    /// switch itself (register state, `switch_mm`, the scheduler's own
    /// path), ~1 us.
    pub ctx_switch_ns: u64,
    /// Charged once to a task that starts on a leaf in a different LLC than
    /// where it last ran: refilling its working set from memory or the
    /// remote cache (tens of KB at ~100 ns per line-miss burst: ~20 us).
    /// Moves inside one LLC cost nothing: the shared LLC keeps the data.
    pub llc_migration_penalty_ns: u64,
    /// Charged to a wakee placed in a different LLC than its waker's leaf:
    /// the wakeup IPI and the cross-cache transfer of the message and wait
    /// queue lines it touches first (~5 us).
    pub remote_wake_ns: u64,
    /// Cost of visiting one leaf (or one child aggregate) in an idle or
    /// steal search, to turn the engine's visit counts
    /// (`sis_scanned + steal_scanned`) into the seed's `%find`: ~20 ns, a
    /// cache-line read of a remote run queue.
    pub find_visit_ns: u64,
}

impl Default for Costs {
    fn default() -> Self {
        Self {
            send_ns: 2_000,
            recv_ns: 2_000,
            ctx_switch_ns: 1_000,
            llc_migration_penalty_ns: 20_000,
            remote_wake_ns: 5_000,
            find_visit_ns: 20,
        }
    }
}

/// Settings of the event loop.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HarnessConfig {
    /// Tick period per leaf (`Sched::tick`); 0 disables ticks.
    pub tick_ns: u64,
    /// The modelled costs.
    pub costs: Costs,
    /// Seed of the PRNG handed to workloads ([`StepCx::rng`]).
    pub seed: u64,
    /// Stop the run at this simulated time (events later are not
    /// processed); `None` runs until no event is left.
    pub time_limit: Option<u64>,
}

impl Default for HarnessConfig {
    fn default() -> Self {
        Self {
            tick_ns: TICK_NS_HZ250,
            costs: Costs::default(),
            seed: 1,
            time_limit: None,
        }
    }
}

/// What a task does next, returned by [`Workload::step`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Stay on the CPU for this many nanoseconds, then step again. A
    /// workload that returns `Run(0)` forever never lets time advance.
    Run(u64),
    /// Sleep until another task wakes it.
    Block,
    /// Sleep for this many nanoseconds, then wake (a timer, no waker).
    Sleep(u64),
    /// Leave the system (`Sched::remove_task`).
    Exit,
}

/// A wake requested during a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct WakeReq {
    task: TaskId,
    sync: bool,
}

/// What a step may see and do besides returning its [`Step`].
#[derive(Debug)]
pub struct StepCx<'a> {
    now: u64,
    costs: &'a Costs,
    rng: &'a mut Rng,
    wakes: &'a mut Vec<WakeReq>,
}

impl StepCx<'_> {
    /// The simulated time of the step.
    pub fn now(&self) -> u64 {
        self.now
    }

    /// The modelled costs.
    pub fn costs(&self) -> &Costs {
        self.costs
    }

    /// The run's seeded PRNG.
    pub fn rng(&mut self) -> &mut Rng {
        self.rng
    }

    /// Wake `task` with the stepping task as waker and `sync = true` (the
    /// waker is expected to sleep soon: pipe and socket writes wake with
    /// `WF_SYNC`). Wakes are issued in order, before the step's result is
    /// applied. Waking a task that is not sleeping is counted as spurious
    /// and otherwise ignored, as `try_to_wake_up` does.
    pub fn wake(&mut self, task: TaskId) {
        self.wakes.push(WakeReq { task, sync: true });
    }

    /// Like [`StepCx::wake`] with an explicit `sync` flag.
    pub fn wake_sync(&mut self, task: TaskId, sync: bool) {
        self.wakes.push(WakeReq { task, sync });
    }
}

/// A set of task state machines.
pub trait Workload {
    /// Task `task` is on a CPU with no work left (just started, or its last
    /// burst completed): perform its next operation.
    fn step(&mut self, task: TaskId, cx: &mut StepCx<'_>) -> Step;
}

/// Errors of harness setup. Runs themselves do not fail: anomalies are
/// counted in [`RunStats`].
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HarnessError {
    /// Task ids must be dense: the next id is `expected`.
    #[error("task id {got:?} given; the harness needs dense ids, next is {expected:?}")]
    NonDenseId {
        /// The id given.
        got: TaskId,
        /// The id expected.
        expected: TaskId,
    },
    /// The engine refused the task.
    #[error(transparent)]
    Sched(#[from] SchedError),
    /// A topology spec could not be parsed.
    #[error(transparent)]
    Topology(#[from] crate::topology::TopologyError),
}

/// Measurements of one run.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RunStats {
    /// Makespan: simulated time when the last task exited (or the run
    /// stopped).
    pub elapsed_ns: u64,
    /// Sum of leaf capacities (CPUs).
    pub capacity: u64,
    /// Running time summed over tasks (CPU time used).
    pub busy_ns: u64,
    /// Tasks registered.
    pub nr_tasks: usize,
    /// Tasks that exited.
    pub nr_exited: usize,
    /// Task-to-task wakeups performed (`ttwu` with a waker).
    pub wakeups: u64,
    /// Of those, wakees placed in another LLC than the waker's leaf.
    pub remote_wakeups: u64,
    /// Wakeups without a waker: the first start of a task (fork) and timer
    /// expiries.
    pub timer_wakeups: u64,
    /// Wakes of tasks that were not sleeping (ignored).
    pub spurious_wakeups: u64,
    /// Times a leaf was left with nothing to run (`sched_goidle`).
    pub goidle: u64,
    /// Starts of a task in another LLC than where it last ran (charged
    /// [`Costs::llc_migration_penalty_ns`]).
    pub llc_moves: u64,
    /// Sum over wakeups of the time from the wake to the task's start.
    pub wake_latency_sum_ns: u64,
    /// Number of wake-to-run latencies summed.
    pub wake_latency_count: u64,
    /// Largest wake-to-run latency.
    pub wake_latency_max_ns: u64,
    /// Every wake-to-run latency as (task index, ns), in order, when
    /// [`Harness::record_wake_latencies`] asked for them (for percentiles
    /// per class); empty otherwise.
    pub wake_latencies: Vec<(u32, u64)>,
    /// Events taken from the heap.
    pub events: u64,
    /// Of those, completions made stale by a preemption.
    pub stale_events: u64,
    /// The engine's schedstats at the end of the run.
    pub stats: Schedstats,
    /// Per-visit search cost used for [`RunStats::pct_find`].
    pub find_visit_ns: u64,
}

impl RunStats {
    /// Percent of the machine's CPU time that tasks ran:
    /// `busy / (capacity x elapsed)`.
    pub fn pct_busy(&self) -> f64 {
        let total = self.capacity as f64 * self.elapsed_ns as f64;
        if total == 0.0 {
            0.0
        } else {
            100.0 * self.busy_ns as f64 / total
        }
    }

    /// Estimated percent of the machine's CPU time spent searching for idle
    /// leaves and tasks to steal: `(sis_scanned + steal_scanned) x
    /// find_visit_ns / (capacity x elapsed)`.
    pub fn pct_find(&self) -> f64 {
        let total = self.capacity as f64 * self.elapsed_ns as f64;
        if total == 0.0 {
            return 0.0;
        }
        let visits = (self.stats.sis_scanned + self.stats.steal_scanned) as f64;
        100.0 * visits * self.find_visit_ns as f64 / total
    }

    /// Mean time from a wakeup to the wakee's start, in nanoseconds.
    pub fn mean_wake_latency_ns(&self) -> f64 {
        if self.wake_latency_count == 0 {
            0.0
        } else {
            self.wake_latency_sum_ns as f64 / self.wake_latency_count as f64
        }
    }

    /// Calls to `schedule()` in schedstat terms: switches to a task plus
    /// switches to idle.
    pub fn sched_count(&self) -> u64 {
        self.stats.nr_switches + self.goidle
    }

    /// Mean running time per switch to a task, in milliseconds (the seed's
    /// `slice`: busy time / (sched - idle)).
    pub fn slice_ms(&self) -> f64 {
        if self.stats.nr_switches == 0 {
            0.0
        } else {
            self.busy_ns as f64 / self.stats.nr_switches as f64 / 1e6
        }
    }

    /// Elapsed time in seconds.
    pub fn elapsed_s(&self) -> f64 {
        self.elapsed_ns as f64 / NSEC_PER_SEC as f64
    }
}

/// Kinds of timed events.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum EventKind {
    /// The running task's burst completes (if `epoch` is still current).
    Burst { task: u32, epoch: u32 },
    /// The periodic tick of a leaf.
    Tick { leaf: u32 },
    /// A wakeup without a waker: a fork or a timer.
    Timer { task: u32 },
}

/// The harness's view of one task.
#[derive(Clone, Debug, Default)]
struct TaskSim {
    /// Leaf it runs on now.
    leaf: Option<LeafId>,
    /// When it last started running (for busy time).
    run_start: u64,
    /// Time from which `remaining` counts down.
    seg_start: u64,
    /// Work left in the current burst (including charged overheads).
    remaining: u64,
    /// Bumped whenever a scheduled completion becomes invalid.
    epoch: u32,
    /// LLC where it last ran.
    last_llc: Option<usize>,
    /// Overheads charged at its next start (remote wakeups).
    pending_overhead: u64,
    /// When it was last woken, until it starts.
    woken_at: Option<u64>,
    /// It exited.
    exited: bool,
}

/// The event loop over one engine and one workload.
#[derive(Debug)]
pub struct Harness<W> {
    sched: Sched,
    workload: W,
    config: HarnessConfig,
    now: u64,
    queue: EventQueue<EventKind>,
    tasks: Vec<TaskSim>,
    /// Tasks running per leaf, as seen from the events.
    running: Vec<u32>,
    tick_armed: Vec<bool>,
    rng: Rng,
    wake_buf: Vec<WakeReq>,
    stats: RunStats,
    last_exit: u64,
    record_latencies: bool,
}

impl<W: Workload> Harness<W> {
    /// A harness over `sched` (which should have no tasks yet) and
    /// `workload`.
    pub fn new(sched: Sched, workload: W, config: HarnessConfig) -> Self {
        let n = sched.topology().nr_leaves();
        let capacity = (0..n).map(|l| sched.rq(l).capacity as u64).sum();
        let rng = Rng::new(config.seed);
        let stats = RunStats {
            capacity,
            find_visit_ns: config.costs.find_visit_ns,
            ..RunStats::default()
        };
        Self {
            sched,
            workload,
            config,
            now: 0,
            queue: EventQueue::new(),
            tasks: Vec::new(),
            running: vec![0; n],
            tick_armed: vec![false; n],
            rng,
            wake_buf: Vec::new(),
            stats,
            last_exit: 0,
            record_latencies: false,
        }
    }

    /// Keep every wake-to-run latency in [`RunStats::wake_latencies`].
    pub fn record_wake_latencies(&mut self) {
        self.record_latencies = true;
    }

    /// The id the next [`Harness::add_task`] must use.
    pub fn next_id(&self) -> TaskId {
        TaskId(self.tasks.len() as u64)
    }

    /// Register a sleeping task; ids must be dense from 0
    /// ([`Harness::next_id`]).
    pub fn add_task(&mut self, spec: TaskSpec) -> Result<TaskId, HarnessError> {
        let expected = self.next_id();
        if spec.id != expected || self.tasks.len() >= u32::MAX as usize {
            return Err(HarnessError::NonDenseId {
                got: spec.id,
                expected,
            });
        }
        self.sched.add_task(spec)?;
        self.tasks.push(TaskSim::default());
        self.stats.nr_tasks += 1;
        Ok(expected)
    }

    /// Start (fork) a registered task at time `at`: it is woken without a
    /// waker, so it is placed by the slow path, as a new task.
    pub fn start_at(&mut self, task: TaskId, at: u64) {
        if let Some(idx) = self.index(task) {
            self.push(at.max(self.now), EventKind::Timer { task: idx });
        }
    }

    /// The engine.
    pub fn sched(&self) -> &Sched {
        &self.sched
    }

    /// The workload.
    pub fn workload(&self) -> &W {
        &self.workload
    }

    /// The simulated clock.
    pub fn now(&self) -> u64 {
        self.now
    }

    /// Measurements so far.
    pub fn stats(&self) -> &RunStats {
        &self.stats
    }

    /// Run until no event is left (or the time limit) and return the
    /// measurements. Running tasks are accounted up to the end.
    pub fn run(&mut self) -> RunStats {
        while let Some(time) = self.queue.peek_time() {
            if self.config.time_limit.is_some_and(|lim| time > lim) {
                break;
            }
            let Some((time, kind)) = self.queue.pop() else {
                break;
            };
            self.now = time;
            self.stats.events += 1;
            match kind {
                EventKind::Burst { task, epoch } => self.on_burst_done(task as usize, epoch),
                EventKind::Tick { leaf } => self.on_tick(leaf as usize),
                EventKind::Timer { task } => self.on_timer(task as usize),
            }
        }
        self.finish()
    }

    fn finish(&mut self) -> RunStats {
        let end = if self.stats.nr_exited == self.tasks.len() && !self.tasks.is_empty() {
            self.last_exit
        } else {
            self.now
        };
        let mut out = self.stats.clone();
        for t in &self.tasks {
            if t.leaf.is_some() {
                out.busy_ns += end.saturating_sub(t.run_start);
            }
        }
        out.elapsed_ns = end;
        out.stats = *self.sched.stats();
        out
    }

    fn index(&self, task: TaskId) -> Option<u32> {
        let i = usize::try_from(task.0).ok()?;
        (i < self.tasks.len()).then_some(i as u32)
    }

    fn push(&mut self, time: u64, kind: EventKind) {
        self.queue.push(time, kind);
    }

    fn arm_tick(&mut self, leaf: LeafId) {
        let tick = self.config.tick_ns;
        if tick == 0 || self.tick_armed[leaf] {
            return;
        }
        self.tick_armed[leaf] = true;
        let at = (self.now / tick + 1) * tick;
        self.push(at, EventKind::Tick { leaf: leaf as u32 });
    }

    // ----- events -----

    fn on_burst_done(&mut self, t: usize, epoch: u32) {
        let ts = &mut self.tasks[t];
        if ts.epoch != epoch || ts.leaf.is_none() {
            self.stats.stale_events += 1;
            return;
        }
        ts.remaining = 0;
        ts.seg_start = self.now;
        self.step(t);
    }

    fn on_tick(&mut self, leaf: LeafId) {
        self.tick_armed[leaf] = false;
        self.sched.tick(leaf, self.now);
        self.process_events();
        if !self.sched.rq(leaf).is_empty() {
            self.arm_tick(leaf);
        }
    }

    fn on_timer(&mut self, t: usize) {
        if self.tasks[t].exited {
            return;
        }
        let id = TaskId(t as u64);
        match self.sched.wake_up(id, None, false, self.now) {
            Ok(_) => {
                self.stats.timer_wakeups += 1;
                self.tasks[t].woken_at = Some(self.now);
            }
            Err(_) => self.stats.spurious_wakeups += 1,
        }
        self.process_events();
    }

    /// Ask the workload for the task's next step and apply it.
    fn step(&mut self, t: usize) {
        let mut wakes = std::mem::take(&mut self.wake_buf);
        wakes.clear();
        let id = TaskId(t as u64);
        let step = {
            let mut cx = StepCx {
                now: self.now,
                costs: &self.config.costs,
                rng: &mut self.rng,
                wakes: &mut wakes,
            };
            self.workload.step(id, &mut cx)
        };
        if let Step::Run(ns) = step {
            // Schedule the completion first: a wake below may preempt the
            // waker, which then keeps this burst as its remaining work.
            let ts = &mut self.tasks[t];
            ts.remaining = ns;
            ts.seg_start = self.now;
            ts.epoch = ts.epoch.wrapping_add(1);
            let epoch = ts.epoch;
            self.push(
                self.now + ns,
                EventKind::Burst {
                    task: t as u32,
                    epoch,
                },
            );
        }
        for w in wakes.drain(..) {
            self.wake(id, w);
        }
        self.wake_buf = wakes;
        match step {
            Step::Run(_) => {}
            Step::Block => self.block(t),
            Step::Sleep(ns) => {
                self.block(t);
                self.push(self.now + ns, EventKind::Timer { task: t as u32 });
            }
            Step::Exit => self.exit(t),
        }
    }

    fn wake(&mut self, waker: TaskId, req: WakeReq) {
        let Some(w) = self.index(req.task) else {
            self.stats.spurious_wakeups += 1;
            return;
        };
        let w = w as usize;
        if self.tasks[w].exited {
            self.stats.spurious_wakeups += 1;
            return;
        }
        let waker_leaf = self.sched.leaf_of(waker);
        match self
            .sched
            .wake_up(req.task, Some(waker), req.sync, self.now)
        {
            Ok(leaf) => {
                self.stats.wakeups += 1;
                let ts = &mut self.tasks[w];
                ts.woken_at = Some(self.now);
                let topo = self.sched.topology();
                if let Some(wl) = waker_leaf
                    && !topo.share_llc(wl, leaf)
                {
                    ts.pending_overhead += self.config.costs.remote_wake_ns;
                    self.stats.remote_wakeups += 1;
                }
            }
            Err(_) => self.stats.spurious_wakeups += 1,
        }
        self.process_events();
    }

    /// Stop accounting a running task (it blocks, exits or is preempted).
    fn stop_running(&mut self, t: usize) -> Option<LeafId> {
        let now = self.now;
        let ts = &mut self.tasks[t];
        let leaf = ts.leaf.take()?;
        self.stats.busy_ns += now - ts.run_start;
        ts.remaining = ts.remaining.saturating_sub(now - ts.seg_start);
        ts.epoch = ts.epoch.wrapping_add(1);
        self.running[leaf] -= 1;
        Some(leaf)
    }

    fn block(&mut self, t: usize) {
        let leaf = self.stop_running(t);
        if self.sched.block(TaskId(t as u64), self.now).is_err() {
            self.stats.spurious_wakeups += 1;
        }
        self.process_events();
        if let Some(leaf) = leaf {
            self.count_goidle(leaf);
        }
    }

    fn exit(&mut self, t: usize) {
        let leaf = self.stop_running(t);
        // remove_task fails only for an unknown id; the harness only exits
        // tasks it registered.
        let _ = self.sched.remove_task(TaskId(t as u64), self.now);
        let ts = &mut self.tasks[t];
        ts.exited = true;
        ts.woken_at = None;
        self.stats.nr_exited += 1;
        self.last_exit = self.now;
        self.process_events();
        if let Some(leaf) = leaf {
            self.count_goidle(leaf);
        }
    }

    /// `sched_goidle`: the leaf that just stopped a task (block or exit) is
    /// left with nothing running once the engine has picked what it could
    /// (its queue, or a stolen task).
    fn count_goidle(&mut self, leaf: LeafId) {
        if self.running[leaf] == 0 {
            self.stats.goidle += 1;
        }
    }

    /// Apply the engine's events: who started, stopped or moved.
    fn process_events(&mut self) {
        loop {
            let events = self.sched.drain_events();
            if events.is_empty() {
                return;
            }
            for ev in events {
                match ev {
                    SchedEvent::Started { task, leaf, .. } => self.on_started(task, leaf),
                    SchedEvent::Preempted { task, .. } => {
                        if let Some(t) = self.index(task) {
                            self.stop_running(t as usize);
                        }
                    }
                    SchedEvent::Migrated { .. } => {}
                }
            }
        }
    }

    fn on_started(&mut self, task: TaskId, leaf: LeafId) {
        let Some(t) = self.index(task) else {
            return;
        };
        let t = t as usize;
        let now = self.now;
        let llc = self.sched.topology().llc_of(leaf);
        let costs = &self.config.costs;
        let ts = &mut self.tasks[t];
        debug_assert!(ts.leaf.is_none(), "task {t} started twice");
        let mut overhead = costs.ctx_switch_ns + std::mem::take(&mut ts.pending_overhead);
        if ts.last_llc.is_some_and(|l| l != llc) {
            overhead += costs.llc_migration_penalty_ns;
            self.stats.llc_moves += 1;
        }
        ts.last_llc = Some(llc);
        ts.leaf = Some(leaf);
        ts.run_start = now;
        ts.seg_start = now;
        ts.remaining += overhead;
        ts.epoch = ts.epoch.wrapping_add(1);
        if let Some(w) = ts.woken_at.take() {
            let lat = now - w;
            self.stats.wake_latency_sum_ns += lat;
            self.stats.wake_latency_count += 1;
            self.stats.wake_latency_max_ns = self.stats.wake_latency_max_ns.max(lat);
            if self.record_latencies {
                self.stats.wake_latencies.push((t as u32, lat));
            }
        }
        let (epoch, remaining) = (ts.epoch, ts.remaining);
        self.running[leaf] += 1;
        self.push(
            now + remaining,
            EventKind::Burst {
                task: t as u32,
                epoch,
            },
        );
        self.arm_tick(leaf);
    }
}

/// Check that a run is consistent: every task exited, busy time fits in
/// the machine's time, and the engine agrees that nothing is left
/// runnable. Returns the problems found (empty when consistent).
pub fn check_conservation(stats: &RunStats, sched: &Sched) -> Vec<String> {
    let mut problems = Vec::new();
    if stats.nr_exited != stats.nr_tasks {
        problems.push(format!(
            "{} of {} tasks exited",
            stats.nr_exited, stats.nr_tasks
        ));
    }
    if stats.busy_ns > stats.capacity * stats.elapsed_ns {
        problems.push(format!(
            "busy {} ns > capacity {} x elapsed {} ns",
            stats.busy_ns, stats.capacity, stats.elapsed_ns
        ));
    }
    if sched.nr_tasks() != 0 {
        problems.push(format!("engine still holds {} tasks", sched.nr_tasks()));
    }
    let n = sched.topology().nr_leaves();
    if let Some(l) = (0..n).find(|&l| !sched.rq(l).is_empty()) {
        problems.push(format!("leaf {l} still has runnable tasks"));
    }
    problems
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::config::SchedConfig;
    use crate::topology::Topology;

    /// Every task burns `burst` once, optionally sleeps, then exits.
    struct Burn {
        burst: u64,
        sleep: u64,
        done: Vec<u8>,
    }

    impl Workload for Burn {
        fn step(&mut self, task: TaskId, _cx: &mut StepCx<'_>) -> Step {
            let i = task.0 as usize;
            self.done[i] += 1;
            match self.done[i] {
                1 => Step::Run(self.burst),
                2 if self.sleep > 0 => Step::Sleep(self.sleep),
                _ => Step::Exit,
            }
        }
    }

    fn harness(spec: &str, tasks: usize, burst: u64, sleep: u64, costs: Costs) -> Harness<Burn> {
        let topo = Arc::new(Topology::from_spec(spec).unwrap());
        let sched = Sched::new(topo, 1, SchedConfig::default());
        let w = Burn {
            burst,
            sleep,
            done: vec![0; tasks],
        };
        let cfg = HarnessConfig {
            costs,
            ..HarnessConfig::default()
        };
        let mut h = Harness::new(sched, w, cfg);
        for _ in 0..tasks {
            let id = h.next_id();
            h.add_task(TaskSpec::new(id)).unwrap();
            h.start_at(id, 0);
        }
        h
    }

    fn free() -> Costs {
        Costs {
            ctx_switch_ns: 0,
            ..Costs::default()
        }
    }

    #[test]
    fn preempted_bursts_resume_and_add_up() {
        // Two 10 ms bursts time-sliced on one CPU: the CPU is never idle,
        // both finish, and the makespan is exactly the work.
        let mut h = harness("1s:1c:1t", 2, 10_000_000, 0, free());
        let s = h.run();
        assert_eq!(s.nr_exited, 2);
        assert_eq!(s.elapsed_ns, 20_000_000);
        assert_eq!(s.busy_ns, 20_000_000);
        assert!(s.stats.nr_preemptions > 0, "ticks time-slice the two tasks");
        assert!(s.stale_events > 0, "preemptions invalidate completions");
        assert!(check_conservation(&s, h.sched()).is_empty());
    }

    #[test]
    fn context_switches_are_charged() {
        let mut h = harness("1s:1c:1t", 2, 10_000_000, 0, Costs::default());
        let s = h.run();
        let switches = s.stats.nr_switches;
        assert_eq!(s.elapsed_ns, 20_000_000 + switches * 1_000);
        assert_eq!(s.busy_ns, s.elapsed_ns);
    }

    #[test]
    fn sleep_wakes_by_timer_and_idle_is_counted() {
        let mut h = harness("1s:2c:1t", 2, 1_000_000, 5_000_000, free());
        let s = h.run();
        assert_eq!(s.nr_exited, 2);
        assert_eq!(s.elapsed_ns, 6_000_000);
        assert_eq!(s.busy_ns, 2_000_000);
        assert_eq!(s.timer_wakeups, 4, "two forks, two timers");
        assert_eq!(s.goidle, 4, "each CPU idles when its task sleeps and exits");
        assert!((s.pct_busy() - 100.0 / 6.0).abs() < 1e-9);
    }

    #[test]
    fn time_limit_stops_the_run() {
        let mut h = harness("1s:1c:1t", 2, 10_000_000, 0, free());
        h.config.time_limit = Some(5_000_000);
        let s = h.run();
        assert!(s.elapsed_ns <= 5_000_000);
        assert_eq!(s.nr_exited, 0);
        assert!(s.busy_ns <= s.elapsed_ns);
    }

    #[test]
    fn ids_must_be_dense() {
        let mut h = harness("1s:1c:1t", 1, 1, 0, free());
        assert!(matches!(
            h.add_task(TaskSpec::new(TaskId(5))),
            Err(HarnessError::NonDenseId { .. })
        ));
    }
}
