//! The run queue of one leaf: the running tasks, the fair timeline of
//! waiting tasks ordered by vruntime, and seed 004's latency timeline.
//!
//! A leaf has a capacity `C` (1 for a CPU, the node's CPUs in the
//! dispatcher). `nr_running` counts runnable demand, running and waiting;
//! the leaf is *overloaded* when `nr_running > C`, which for `C = 1` is the
//! kernel's `nr_running >= 2` (seed 000 patch 4); with backfill the engine
//! also counts a leaf with waiting work as overloaded, and lets a newcomer
//! use the room that cannot delay the head's reservation
//! ([`crate::Sched::reservation`]). Keys carry an enqueue
//! sequence number so that equal vruntimes keep FIFO order.

use std::collections::BTreeSet;

use crate::alloc::{Align, FreeSummary};
use crate::task::TaskId;

/// Key in a timeline: (virtual time, enqueue sequence, task).
pub type TimelineKey = (i64, u64, TaskId);

/// One leaf's queue state. Mutated only by the engine.
#[derive(Clone, Debug)]
pub struct RunQueue {
    /// Capacity units (`C`).
    pub capacity: u32,
    /// Runnable demand: running plus waiting.
    pub nr_running: u32,
    /// Demand of the running tasks.
    pub running_demand: u32,
    /// Tasks running now.
    pub running: Vec<TaskId>,
    /// Waiting tasks by vruntime (`tasks_timeline`).
    pub(crate) tasks_timeline: BTreeSet<TimelineKey>,
    /// Waiting latency-sensitive tasks by vruntime + latency_offset
    /// (`latency_timeline`, seed 004).
    pub(crate) latency_timeline: BTreeSet<TimelineKey>,
    /// Sum of the weights of runnable tasks (`cfs_rq->load.weight`).
    pub load_weight: u64,
    /// Monotonic floor of the vruntimes (`min_vruntime`).
    pub min_vruntime: i64,
    /// Average idle period (`rq->avg_idle`).
    pub avg_idle: u64,
    /// When the leaf last became fully idle (`rq->idle_stamp`).
    pub idle_stamp: Option<u64>,
    /// Shadow of the overload-mask bit: set exactly on transitions.
    pub(crate) overloaded: bool,
    /// Room per alignment level inside the leaf, when the leaf is itself a
    /// machine (the dispatcher's nodes): what its agent reported, lowered
    /// conservatively as jobs start until the next report. `None` for CPUs.
    pub(crate) align_free: Option<FreeSummary>,
    /// With backfill on and tasks waiting: the capacity a newcomer of
    /// unknown length may use now without delaying the head's reservation
    /// (the reservation's extra capacity). `None`: backfill off, nothing
    /// waiting, or not computed yet.
    pub(crate) backfill_room: Option<u32>,
}

impl RunQueue {
    /// An empty queue of `capacity` units.
    pub fn new(capacity: u32, avg_idle: u64) -> Self {
        Self {
            capacity,
            nr_running: 0,
            running_demand: 0,
            running: Vec::new(),
            tasks_timeline: BTreeSet::new(),
            latency_timeline: BTreeSet::new(),
            load_weight: 0,
            min_vruntime: 0,
            avg_idle,
            idle_stamp: None,
            overloaded: false,
            align_free: None,
            backfill_room: None,
        }
    }

    /// Number of waiting (runnable, not running) tasks.
    pub fn nr_waiting(&self) -> usize {
        self.tasks_timeline.len()
    }

    /// More runnable demand than capacity.
    pub fn is_overloaded(&self) -> bool {
        self.nr_running > self.capacity
    }

    /// Capacity not used by running tasks.
    pub fn free(&self) -> u32 {
        self.capacity.saturating_sub(self.running_demand)
    }

    /// Capacity a newcomer could use now: free capacity, or, when tasks
    /// are already waiting (they go first), 0, or with backfill the room
    /// that cannot delay the head's reservation.
    pub fn fit_free(&self) -> u32 {
        if self.tasks_timeline.is_empty() {
            self.free()
        } else {
            self.backfill_room.unwrap_or(0).min(self.free())
        }
    }

    /// Some capacity is free now, whatever waits (backfill and idle
    /// balance look for work for it).
    pub fn has_spare(&self) -> bool {
        self.can_start(1, Align::Any)
    }

    /// The leaf's room per alignment level, if it is a machine.
    pub fn align_free(&self) -> Option<FreeSummary> {
        self.align_free
    }

    /// Room a newcomer with alignment `align` could use now: `fit_free`,
    /// capped by the leaf's per-level room when it has one.
    pub fn room(&self, align: Align) -> u32 {
        let f = self.fit_free();
        match &self.align_free {
            None => f,
            Some(s) => f.min(s.get(align)),
        }
    }

    /// True when a task of `demand` and `align` can start now, ignoring
    /// the queue (used when picking the queue's own next task).
    pub fn can_start(&self, demand: u32, align: Align) -> bool {
        self.free() >= demand && self.align_free.is_none_or(|s| s.get(align) >= demand)
    }

    /// Idle: room for a newcomer (nothing waiting and some capacity free;
    /// with backfill, room that cannot delay the head). For `C = 1` this is
    /// the kernel's `available_idle_cpu`.
    pub fn is_idle(&self) -> bool {
        self.room(Align::Any) > 0
    }

    /// Nothing running or waiting.
    pub fn is_empty(&self) -> bool {
        self.nr_running == 0
    }

    /// Waiting tasks in fair (vruntime) order.
    pub fn waiting(&self) -> impl Iterator<Item = TaskId> + '_ {
        self.tasks_timeline.iter().map(|k| k.2)
    }

    /// Leftmost waiting task of the fair timeline.
    pub(crate) fn first_fair(&self) -> Option<TimelineKey> {
        self.tasks_timeline.first().copied()
    }

    /// Leftmost waiting task of the latency timeline.
    pub(crate) fn first_latency(&self) -> Option<TimelineKey> {
        self.latency_timeline.first().copied()
    }
}
