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
//!
//! Beside each timeline, the multiset of its tasks' demands
//! ([`DemandSet`]), kept exactly on every insert and remove: a steal
//! search skips a source whose smallest waiting demand exceeds what the
//! stealer could start at all ([`RunQueue::start_bound`]), without walking
//! its queue.
//!
//! The timelines, their demand sets and the backfill room live in one
//! [`Waiting`] record, allocated only while a task waits on the leaf: most
//! leaves of a cluster have nothing waiting, and an empty record would
//! cost every leaf ~100 bytes. "Nothing waits" is the record's absence
//! ([`RunQueue::nothing_waits`]). The running tasks are one pointer
//! ([`Running`]) until the leaf's first start. [`OptTime`], the 8-byte
//! optional time of the engine's per-leaf tables (the idle stamp here,
//! the deferred tick and missed predictions in `Sched`), is defined here
//! too.

use std::collections::{BTreeMap, BTreeSet};

use crate::alloc::{Align, FreeSummary};
use crate::task::TaskId;

/// Key in a timeline: (virtual time, enqueue sequence, task).
pub type TimelineKey = (i64, u64, TaskId);

/// A multiset of demands (count per demand): the waiting tasks of a
/// timeline, or of every leaf of an LLC. Its minimum is what a steal
/// search compares with the stealer's [`RunQueue::start_bound`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DemandSet(BTreeMap<u32, u32>);

impl DemandSet {
    /// Add one task of `demand`.
    pub fn insert(&mut self, demand: u32) {
        *self.0.entry(demand).or_insert(0) += 1;
    }

    /// Remove one task of `demand` (present: the engine removes only what
    /// it inserted).
    pub fn remove(&mut self, demand: u32) {
        if let Some(n) = self.0.get_mut(&demand) {
            *n -= 1;
            if *n == 0 {
                self.0.remove(&demand);
            }
        }
    }

    /// The smallest demand; `None` when empty.
    pub fn min(&self) -> Option<u32> {
        self.0.first_key_value().map(|(&d, _)| d)
    }

    /// True when some member's demand is at most `bound`.
    pub fn any_within(&self, bound: u32) -> bool {
        self.min().is_some_and(|d| d <= bound)
    }

    /// Number of members.
    pub fn len(&self) -> usize {
        self.0.values().map(|&n| n as usize).sum()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The members' (demand, count) pairs, smallest demand first.
    pub fn counts(&self) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.0.iter().map(|(&d, &n)| (d, n))
    }
}

/// An optional time in 8 bytes (an `Option<u64>` takes 16): `u64::MAX`,
/// a time in ns no clock of the engine reaches, is "none". For the
/// per-leaf tables, one entry per node of a cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct OptTime(u64);

impl OptTime {
    pub(crate) const NONE: Self = Self(u64::MAX);

    #[inline]
    pub(crate) fn get(self) -> Option<u64> {
        (self.0 != u64::MAX).then_some(self.0)
    }

    #[inline]
    pub(crate) fn set(&mut self, t: Option<u64>) {
        debug_assert!(t != Some(u64::MAX), "a time at the end of the clock");
        self.0 = t.unwrap_or(u64::MAX);
    }

    #[inline]
    pub(crate) fn take(&mut self) -> Option<u64> {
        let t = self.get();
        *self = Self::NONE;
        t
    }
}

static EMPTY_DEMANDS: DemandSet = DemandSet(BTreeMap::new());

/// The tasks running on a leaf, in start order: a vector allocated by the
/// leaf's first start and kept from then on, behind one pointer (8 bytes
/// of every [`RunQueue`] where a `Vec` takes 24: most leaves of a
/// cluster's engine, rebuilt on every registration burst, never ran a
/// task). Reads as a slice.
// The box around the vector is the point (clippy: box_collection).
#[allow(clippy::box_collection)]
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Running(Option<Box<Vec<TaskId>>>);

impl Running {
    /// The running tasks, in start order.
    #[inline]
    pub fn as_slice(&self) -> &[TaskId] {
        match &self.0 {
            Some(v) => v,
            None => &[],
        }
    }

    /// Add a task that starts.
    #[inline]
    pub(crate) fn push(&mut self, id: TaskId) {
        self.0.get_or_insert_with(Box::default).push(id);
    }

    /// Take `id` off where it is, keeping the others' order; true when it
    /// was there.
    #[inline]
    pub(crate) fn remove(&mut self, id: TaskId) -> bool {
        let Some(v) = self.0.as_deref_mut() else {
            return false;
        };
        match v.iter().position(|&x| x == id) {
            Some(p) => {
                v.remove(p);
                true
            }
            None => false,
        }
    }
}

impl std::ops::Deref for Running {
    type Target = [TaskId];

    #[inline]
    fn deref(&self) -> &[TaskId] {
        self.as_slice()
    }
}

impl<'a> IntoIterator for &'a Running {
    type Item = &'a TaskId;
    type IntoIter = std::slice::Iter<'a, TaskId>;

    #[inline]
    fn into_iter(self) -> Self::IntoIter {
        self.as_slice().iter()
    }
}

/// The waiting state of one leaf: present exactly while its fair timeline
/// holds a task (every task of the latency timeline is in the fair one
/// too).
#[derive(Clone, Debug, Default)]
pub(crate) struct Waiting {
    /// Waiting tasks by vruntime (`tasks_timeline`).
    pub(crate) tasks_timeline: BTreeSet<TimelineKey>,
    /// Waiting latency-sensitive tasks by vruntime + latency_offset
    /// (`latency_timeline`, seed 004).
    pub(crate) latency_timeline: BTreeSet<TimelineKey>,
    /// The tasks of `tasks_timeline` with a time limit or a run-time
    /// prediction, keyed as there: when none waiting is small enough for
    /// the head's extra room, the only ones EASY backfill may start past
    /// the head, so its pass walks these alone.
    pub(crate) bounded_timeline: BTreeSet<TimelineKey>,
    /// Demands of the tasks of `tasks_timeline`.
    pub(crate) wait_demands: DemandSet,
    /// Demands of the tasks of `latency_timeline`.
    pub(crate) latency_demands: DemandSet,
    /// With backfill on: the capacity a newcomer of unknown length may
    /// use now without delaying the head's reservation (the reservation's
    /// extra capacity). `None`: backfill off, or not computed yet.
    pub(crate) backfill_room: Option<u32>,
}

/// One leaf's queue state. Mutated only by the engine.
#[derive(Clone, Debug)]
pub struct RunQueue {
    /// Capacity units (`C`).
    pub capacity: u32,
    /// Runnable demand: running plus waiting.
    pub nr_running: u32,
    /// Demand of the running tasks.
    pub running_demand: u32,
    /// Tasks running now, in start order.
    pub running: Running,
    /// The timelines of the waiting tasks and their demands; `None`
    /// while nothing waits.
    pub(crate) waiting: Option<Box<Waiting>>,
    /// Sum of the weights of runnable tasks (`cfs_rq->load.weight`).
    pub load_weight: u64,
    /// Monotonic floor of the vruntimes (`min_vruntime`), as of the
    /// leaf's last tick accounting: read it through
    /// [`crate::Sched::min_vruntime`], which includes a deferred tick.
    pub(crate) min_vruntime: i64,
    /// Average idle period (`rq->avg_idle`).
    pub avg_idle: u64,
    /// When the leaf last became fully idle (`rq->idle_stamp`): read it
    /// through [`RunQueue::idle_stamp`].
    pub(crate) idle_stamp: OptTime,
    /// Shadow of the overload-mask bit: set exactly on transitions.
    pub(crate) overloaded: bool,
    /// Room per alignment level inside the leaf, when the leaf is itself a
    /// machine (the dispatcher's nodes): what its agent reported, lowered
    /// conservatively as jobs start until the next report. `None` for CPUs.
    pub(crate) align_free: Option<FreeSummary>,
}

impl RunQueue {
    /// An empty queue of `capacity` units.
    pub fn new(capacity: u32, avg_idle: u64) -> Self {
        Self {
            capacity,
            nr_running: 0,
            running_demand: 0,
            running: Running::default(),
            waiting: None,
            load_weight: 0,
            min_vruntime: 0,
            avg_idle,
            idle_stamp: OptTime::NONE,
            overloaded: false,
            align_free: None,
        }
    }

    /// When the leaf last became fully idle, if it is.
    pub fn idle_stamp(&self) -> Option<u64> {
        self.idle_stamp.get()
    }

    /// Number of waiting (runnable, not running) tasks.
    pub fn nr_waiting(&self) -> usize {
        self.waiting.as_ref().map_or(0, |w| w.tasks_timeline.len())
    }

    /// No task waits (the fair timeline is empty).
    #[inline]
    pub fn nothing_waits(&self) -> bool {
        self.waiting.is_none()
    }

    /// Put a waiting task in the fair timeline (and its demand in
    /// `wait_demands`, and the task in `bounded_timeline` when `bounded`:
    /// it has a time limit or a prediction); true when the key was new.
    pub(crate) fn enqueue_fair(&mut self, key: TimelineKey, demand: u32, bounded: bool) -> bool {
        let w = self.waiting.get_or_insert_with(Box::default);
        w.wait_demands.insert(demand);
        if bounded {
            w.bounded_timeline.insert(key);
        }
        w.tasks_timeline.insert(key)
    }

    /// Put a waiting task (already in the fair timeline) in the latency
    /// timeline too.
    pub(crate) fn enqueue_latency(&mut self, key: TimelineKey, demand: u32) {
        let w = self.waiting.get_or_insert_with(Box::default);
        w.latency_demands.insert(demand);
        w.latency_timeline.insert(key);
    }

    /// Take a waiting task off the fair timeline, and off the latency
    /// timeline under `latency` when it is there; the waiting record goes
    /// when the fair timeline empties. True when the fair key was there.
    pub(crate) fn dequeue_waiting(
        &mut self,
        key: TimelineKey,
        demand: u32,
        latency: Option<TimelineKey>,
    ) -> bool {
        let Some(w) = self.waiting.as_deref_mut() else {
            return false;
        };
        let removed = w.tasks_timeline.remove(&key);
        w.bounded_timeline.remove(&key);
        w.wait_demands.remove(demand);
        if let Some(k) = latency {
            w.latency_timeline.remove(&k);
            w.latency_demands.remove(demand);
        }
        if w.tasks_timeline.is_empty() {
            debug_assert!(
                w.latency_timeline.is_empty()
                    && w.bounded_timeline.is_empty()
                    && w.wait_demands.is_empty()
                    && w.latency_demands.is_empty(),
                "a task waits outside the fair timeline"
            );
            self.waiting = None;
        }
        removed
    }

    /// Set the backfill room (kept only while something waits).
    pub(crate) fn set_backfill_room(&mut self, room: Option<u32>) {
        if let Some(w) = self.waiting.as_deref_mut() {
            w.backfill_room = room;
        }
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
        match &self.waiting {
            None => self.free(),
            Some(w) => w.backfill_room.unwrap_or(0).min(self.free()),
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

    /// [`Rq::room`] at every alignment (indexed by `Align::index`), with
    /// `fit_free` computed once.
    pub fn rooms(&self) -> [u32; 5] {
        let f = self.fit_free();
        match &self.align_free {
            None => [f; 5],
            Some(s) => Align::ALL.map(|align| f.min(s.get(align))),
        }
    }

    /// True when a task of `demand` and `align` can start now, ignoring
    /// the queue (used when picking the queue's own next task).
    pub fn can_start(&self, demand: u32, align: Align) -> bool {
        self.free() >= demand && self.align_free.is_none_or(|s| s.get(align) >= demand)
    }

    /// The largest demand [`RunQueue::can_start`] could accept now, of
    /// any alignment: no task of a larger demand can start here, so a
    /// steal search skips sources whose every waiting task is larger (every
    /// "fits" test, [`crate::Sched::fits_now`] included, needs
    /// `can_start`).
    pub fn start_bound(&self) -> u32 {
        let free = self.free();
        match &self.align_free {
            None => free,
            Some(s) => free.min(Align::ALL.iter().map(|&a| s.get(a)).max().unwrap_or(0)),
        }
    }

    /// Demands of the waiting tasks (the fair timeline).
    pub fn wait_demands(&self) -> &DemandSet {
        self.waiting
            .as_ref()
            .map_or(&EMPTY_DEMANDS, |w| &w.wait_demands)
    }

    /// Demands of the tasks of the latency timeline.
    pub fn latency_demands(&self) -> &DemandSet {
        self.waiting
            .as_ref()
            .map_or(&EMPTY_DEMANDS, |w| &w.latency_demands)
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
        self.waiting
            .iter()
            .flat_map(|w| w.tasks_timeline.iter().map(|k| k.2))
    }

    /// The waiting tasks with a time limit or a run-time prediction, in
    /// fair (vruntime) order.
    pub fn waiting_bounded(&self) -> impl Iterator<Item = TaskId> + '_ {
        self.waiting
            .iter()
            .flat_map(|w| w.bounded_timeline.iter().map(|k| k.2))
    }

    /// Waiting tasks of the latency timeline, in its order.
    pub fn latency_waiting(&self) -> impl Iterator<Item = TaskId> + '_ {
        self.latency_keys().map(|k| k.2)
    }

    /// The latency timeline's keys, in its order.
    pub(crate) fn latency_keys(&self) -> impl Iterator<Item = &TimelineKey> + '_ {
        self.waiting.iter().flat_map(|w| w.latency_timeline.iter())
    }

    /// Leftmost waiting task of the fair timeline.
    pub(crate) fn first_fair(&self) -> Option<TimelineKey> {
        self.waiting.as_ref()?.tasks_timeline.first().copied()
    }

    /// Leftmost waiting task of the latency timeline.
    pub(crate) fn first_latency(&self) -> Option<TimelineKey> {
        self.waiting.as_ref()?.latency_timeline.first().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// `Running` against a `Vec` (the oracle, as `running` was): the
        /// same tasks in the same order after any starts and removals,
        /// removal true exactly when the task was there.
        #[test]
        fn running_is_the_vector_of_starts(
            ops in proptest::collection::vec((proptest::bool::ANY, 0u64..8), 0..60),
        ) {
            let mut r = Running::default();
            let mut oracle: Vec<TaskId> = Vec::new();
            for (start, id) in ops {
                let id = TaskId(id);
                if start {
                    r.push(id);
                    oracle.push(id);
                } else {
                    let there = oracle.iter().position(|&x| x == id);
                    if let Some(p) = there {
                        oracle.remove(p);
                    }
                    proptest::prop_assert_eq!(r.remove(id), there.is_some());
                }
                proptest::prop_assert_eq!(r.as_slice(), oracle.as_slice());
                proptest::prop_assert_eq!(r.is_empty(), oracle.is_empty());
                proptest::prop_assert_eq!(r.last(), oracle.last());
                let iterated: Vec<TaskId> = (&r).into_iter().copied().collect();
                proptest::prop_assert_eq!(iterated, oracle.clone());
            }
        }
    }

    /// The per-leaf record stays small: a cluster's engine has one per
    /// node.
    #[test]
    fn a_run_queue_is_88_bytes() {
        assert_eq!(std::mem::size_of::<Running>(), 8);
        assert_eq!(std::mem::size_of::<RunQueue>(), 88);
    }
}
