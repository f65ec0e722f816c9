//! Placement, `select_task_rq`: where a waking or new task goes.
//!
//! The order is the kernel's `select_task_rq_fair` with the seeds'
//! changes: `record_wakee`, then `wake_wide` (seed 001) decides whether the
//! waker's leaf is a candidate at all; `wake_affine` picks between the
//! waker's leaf and the previous one; `select_idle_sibling` looks for idle
//! room near that target in the kernel's order (target, prev if it shares
//! the LLC, recently used, idle core, idle leaf, idle SMT sibling, else
//! target), counting the schedstats of seed 000 patch 10 and skipping LLCs
//! flagged fully busy (seed 003). New tasks without a waker, and wakees
//! sent wide that have no previous leaf, take the slow path `find_idlest`,
//! a descent of the domain tree on exact aggregates; the pack policy
//! (seed 002) takes the highest-priority core with room while the load is
//! below the threshold.
//!
//! Every placement reports how it chose ([`Placement`]): callers explain a
//! decision from that value, never by diffing the schedstats.

use crate::config::{PackThreshold, Policy};
use crate::idlest::fixed_share;
use crate::sched::Sched;
use crate::task::{TaskId, TaskState};
use crate::topology::LeafId;
use crate::wake::{IMBALANCE_PCT, record_wakee, wake_wide};

/// What the waker relation decided in `select_task_rq`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum WakeChoice {
    /// No waker on a leaf, or the pack policy decided first.
    #[default]
    None,
    /// `wake_wide`: the waker fans out, the waker's leaf is no candidate.
    Wide,
    /// `wake_affine` chose the waker's leaf as the target.
    Affine,
    /// `wake_affine` kept the previous leaf as the target.
    Prev,
}

/// The search that produced the leaf.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum PlacePath {
    /// The pack policy (seed 002): highest-priority core with room.
    Pack,
    /// `select_idle_sibling`: the target, prev or recently used leaf had
    /// room (schedstat `sis_easy`).
    #[default]
    Target,
    /// `select_idle_sibling`: an idle core of the target's LLC.
    IdleCore,
    /// `select_idle_sibling`: an idle leaf (or SMT sibling) of the LLC.
    IdleLeaf,
    /// `select_idle_sibling` found nothing idle: the target.
    NoneIdle,
    /// `select_idle_sibling` skipped the LLC flagged fully busy (seed 003).
    BusySkip,
    /// The slow path, `find_idlest`.
    Idlest,
    /// `find_idlest` skipped the root flagged fully busy: least loaded leaf.
    IdlestBusySkip,
}

impl PlacePath {
    /// A short stable name (for metrics labels).
    pub fn name(self) -> &'static str {
        match self {
            PlacePath::Pack => "pack",
            PlacePath::Target => "target",
            PlacePath::IdleCore => "idle_core",
            PlacePath::IdleLeaf => "idle_leaf",
            PlacePath::NoneIdle => "none_idle",
            PlacePath::BusySkip => "busy_skip",
            PlacePath::Idlest => "idlest",
            PlacePath::IdlestBusySkip => "idlest_busy_skip",
        }
    }
}

/// How `select_task_rq` placed a task: the decision as data.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Placement {
    /// What the waker relation decided.
    pub wake: WakeChoice,
    /// The search that produced the leaf.
    pub path: PlacePath,
}

impl Sched {
    /// Where task `id` should run. Records the waker's wakee flips.
    pub fn select_task_rq(
        &mut self,
        id: TaskId,
        waker: Option<TaskId>,
        sync: bool,
        now: u64,
    ) -> LeafId {
        self.select_task_rq_placed(id, waker, sync, now).0
    }

    /// [`Sched::select_task_rq`], with how it chose.
    pub fn select_task_rq_placed(
        &mut self,
        id: TaskId,
        waker: Option<TaskId>,
        sync: bool,
        now: u64,
    ) -> (LeafId, Placement) {
        self.flush_aggregates();
        let mut how = Placement::default();
        let Some(task) = self.tasks.get(&id) else {
            return (0, how);
        };
        let prev = task.prev_leaf;
        let this = waker.and_then(|w| self.leaf_of(w));
        if let Some(w) = waker
            && w != id
            && let Some(wt) = self.tasks.get_mut(&w)
        {
            record_wakee(wt, id, now);
        }

        if let Some(leaf) = self.pack_first(id, prev.or(this)) {
            how.path = PlacePath::Pack;
            return (leaf, how);
        }

        let mut want_affine = false;
        if let (Some(w), Some(this)) = (waker, this)
            && self.config.wake_affine
            && w != id
        {
            let wide = self.config.wake_wide
                && match (self.tasks.get(&id), self.tasks.get(&w)) {
                    (Some(p), Some(wt)) => wake_wide(p, wt, self.topo.sd_llc_size(this)),
                    _ => false,
                };
            if wide {
                self.stats.wake_wide += 1;
                how.wake = WakeChoice::Wide;
            }
            want_affine = !wide && self.allowed(id, this);
        }

        let (leaf, path) = match prev.filter(|&p| self.allowed(id, p)) {
            None => {
                if let (true, Some(this)) = (want_affine, this) {
                    self.stats.wake_affine += 1;
                    how.wake = WakeChoice::Affine;
                    self.select_idle_sibling_placed(id, this, this)
                } else {
                    self.find_idlest_placed(id)
                }
            }
            Some(prev) => {
                let target = match (want_affine, this) {
                    (true, Some(this)) => {
                        let (t, affine) = self.wake_affine(id, waker, this, prev, sync);
                        how.wake = if affine {
                            WakeChoice::Affine
                        } else {
                            WakeChoice::Prev
                        };
                        t
                    }
                    _ => prev,
                };
                self.select_idle_sibling_placed(id, prev, target)
            }
        };
        how.path = path;
        (leaf, how)
    }

    /// The leaf a task is on or last was on.
    pub fn leaf_of(&self, id: TaskId) -> Option<LeafId> {
        let t = self.tasks.get(&id)?;
        match t.state {
            TaskState::Running(l) | TaskState::Queued(l) => Some(l),
            TaskState::Sleeping => t.prev_leaf,
        }
    }

    pub(crate) fn allowed(&self, id: TaskId, leaf: LeafId) -> bool {
        self.tasks.get(&id).is_some_and(|t| t.allowed(leaf))
    }

    /// True when the task may start on `leaf` now: allowed, nothing waiting
    /// there, and room for its demand (`available_idle_cpu` at C = 1).
    pub fn fits(&self, id: TaskId, leaf: LeafId) -> bool {
        self.tasks
            .get(&id)
            .is_some_and(|t| t.allowed(leaf) && self.rqs[leaf].room(t.align) >= t.demand)
    }

    /// `wake_affine`: the waker's leaf or the previous one (WA_IDLE, then
    /// WA_WEIGHT); true when it chose the waker's (`wake_affine` counted).
    fn wake_affine(
        &mut self,
        id: TaskId,
        waker: Option<TaskId>,
        this: LeafId,
        prev: LeafId,
        sync: bool,
    ) -> (LeafId, bool) {
        // wake_affine_idle
        if self.rqs[this].is_idle() && self.topo.share_llc(this, prev) {
            let t = if self.rqs[prev].is_idle() { prev } else { this };
            if t == this {
                self.stats.wake_affine += 1;
            }
            return (t, t == this);
        }
        if sync && self.rqs[this].nr_running == 1 {
            self.stats.wake_affine += 1;
            return (this, true);
        }
        // wake_affine_weight
        let weight = self.tasks.get(&id).map_or(0, |t| t.weight);
        let waker_weight = match (sync, waker.and_then(|w| self.tasks.get(&w))) {
            (true, Some(w)) => w.weight,
            _ => 0,
        };
        let this_load = self.rqs[this].load_weight.saturating_sub(waker_weight) + weight;
        let this_eff = this_load as u128 * 100 * self.rqs[prev].capacity.max(1) as u128;
        let prev_eff = self.rqs[prev].load_weight as u128
            * (100 + (IMBALANCE_PCT - 100) / 2) as u128
            * self.rqs[this].capacity.max(1) as u128;
        if this_eff < prev_eff {
            self.stats.wake_affine += 1;
            (this, true)
        } else {
            (prev, false)
        }
    }

    /// `select_idle_sibling`: idle room near `target`, in the kernel's
    /// order; `target` when there is none.
    pub fn select_idle_sibling(&mut self, id: TaskId, prev: LeafId, target: LeafId) -> LeafId {
        self.select_idle_sibling_placed(id, prev, target).0
    }

    pub(crate) fn select_idle_sibling_placed(
        &mut self,
        id: TaskId,
        prev: LeafId,
        target: LeafId,
    ) -> (LeafId, PlacePath) {
        self.stats.sis_scanned += 1;
        if self.fits(id, target) {
            self.stats.sis_easy += 1;
            return (target, PlacePath::Target);
        }
        if prev != target && self.topo.share_llc(prev, target) && self.fits(id, prev) {
            self.stats.sis_easy += 1;
            return (prev, PlacePath::Target);
        }
        let recent = self.tasks.get(&id).and_then(|t| t.recent_used_leaf);
        if let Some(recent) = recent
            && recent != prev
            && recent != target
            && self.topo.share_llc(recent, target)
            && self.fits(id, recent)
        {
            if let Some(t) = self.tasks.get_mut(&id) {
                t.recent_used_leaf = Some(prev);
            }
            self.stats.sis_easy += 1;
            return (recent, PlacePath::Target);
        }
        if self.config.busy_skip && self.busy.is_busy(self.topo.sd_llc(target)) {
            self.stats.busy_skip += 1;
            self.stats.sis_none += 1;
            return (target, PlacePath::BusySkip);
        }
        if let Some(leaf) = self.select_idle_core(id, target) {
            self.stats.sis_core += 1;
            return (leaf, PlacePath::IdleCore);
        }
        if let Some(leaf) = self.select_idle_cpu(id, target) {
            self.stats.sis_cpu += 1;
            return (leaf, PlacePath::IdleLeaf);
        }
        if let Some(leaf) = self.select_idle_smt(id, target) {
            self.stats.sis_cpu += 1;
            return (leaf, PlacePath::IdleLeaf);
        }
        self.stats.sis_none += 1;
        (target, PlacePath::NoneIdle)
    }

    /// `select_idle_core`: a core of the target's LLC whose every leaf is
    /// empty, scanning from the target with wrap. Only on SMT machines.
    fn select_idle_core(&mut self, id: TaskId, target: LeafId) -> Option<LeafId> {
        if self.topo.smt_siblings(target).len() < 2 {
            return None;
        }
        let topo = self.topo.clone();
        let members = &topo.llcs()[topo.llc_of(target)].members;
        let start = topo.llc_pos(target);
        let n = members.len();
        let mut last_core = usize::MAX;
        for i in 0..n {
            let leaf = members[(start + i) % n];
            let core = topo.core_of(leaf);
            if core == last_core {
                continue;
            }
            last_core = core;
            let sibs = topo.smt_siblings(leaf);
            self.stats.sis_scanned += sibs.len() as u64;
            if sibs.iter().all(|&s| self.rqs[s].is_empty())
                && let Some(&l) = sibs.iter().find(|&&s| self.fits(id, s))
            {
                return Some(l);
            }
        }
        None
    }

    /// `select_idle_cpu`: the first leaf of the target's LLC with room,
    /// scanning from the target with wrap.
    fn select_idle_cpu(&mut self, id: TaskId, target: LeafId) -> Option<LeafId> {
        let topo = self.topo.clone();
        let members = &topo.llcs()[topo.llc_of(target)].members;
        let start = topo.llc_pos(target);
        let n = members.len();
        for i in 0..n {
            let leaf = members[(start + i) % n];
            self.stats.sis_scanned += 1;
            if self.fits(id, leaf) {
                return Some(leaf);
            }
        }
        None
    }

    /// `select_idle_smt`: an SMT sibling of the target with room.
    fn select_idle_smt(&mut self, id: TaskId, target: LeafId) -> Option<LeafId> {
        let topo = self.topo.clone();
        topo.smt_siblings(target)
            .iter()
            .copied()
            .find(|&s| s != target && self.fits(id, s))
    }

    /// The slow path (`find_idlest_cpu`): descend from the root into the
    /// child with the largest share of free capacity that can hold the
    /// task. A root flagged fully busy is not scanned: the task goes to the
    /// least-loaded leaf, found on the aggregates. Always returns a leaf the
    /// task is allowed on.
    pub fn find_idlest(&mut self, id: TaskId) -> LeafId {
        self.find_idlest_placed(id).0
    }

    pub(crate) fn find_idlest_placed(&mut self, id: TaskId) -> (LeafId, PlacePath) {
        self.flush_aggregates();
        self.stats.find_idlest += 1;
        let idlest = |leaf| (leaf, PlacePath::Idlest);
        let Some(task) = self.tasks.get(&id) else {
            return idlest(0);
        };
        let (demand, align) = (task.demand, task.align);
        if let Some(aff) = task.affinity.clone() {
            // Constrained tasks: examine only their allowed leaves.
            let mut best: Option<(LeafId, (bool, u64, i64))> = None;
            for leaf in aff.iter().filter(|&l| l < self.topo.nr_leaves()) {
                self.stats.sis_scanned += 1;
                let rq = &self.rqs[leaf];
                let key = (
                    rq.room(align) >= demand,
                    rq.room(align) as u64,
                    -(rq.nr_running as i64 * 1024 / rq.capacity.max(1) as i64),
                );
                if best.as_ref().is_none_or(|b| key > b.1) {
                    best = Some((leaf, key));
                }
            }
            return idlest(best.map_or(0, |b| b.0));
        }
        let root = self.topo.root();
        let skip_busy = self.config.busy_skip;
        if skip_busy && self.busy.is_busy(root) {
            self.stats.busy_skip += 1;
            return (self.least_loaded(), PlacePath::IdlestBusySkip);
        }
        if self.agg(root).max_room[align.index()] < demand {
            return idlest(self.least_loaded());
        }
        let mut node = root;
        loop {
            if self.topo.node(node).is_leaf() {
                return idlest(node);
            }
            match self.idlest_child(node, align, demand) {
                Some(c) => node = c,
                None => return idlest(self.least_loaded()),
            }
        }
    }

    /// `find_idlest`'s choice among `node`'s children: the largest free
    /// share (32.32 fixed point), then the most free, then the first,
    /// among those with room for `demand` at `align` (and not busy, with
    /// busy-skip on): from the index, not a scan of the children. Counts
    /// the children examined in `sis_scanned`.
    #[inline]
    pub(crate) fn idlest_child(
        &mut self,
        node: crate::topology::NodeId,
        align: crate::alloc::Align,
        demand: u32,
    ) -> Option<crate::topology::NodeId> {
        let skip_busy = self.config.busy_skip;
        let (busy, mut visited) = (&self.busy, 0);
        let best = self.idlest.idlest_child(
            &self.topo,
            node,
            align,
            demand,
            |c| !(skip_busy && busy.is_busy(c)),
            &mut visited,
        );
        self.stats.sis_scanned += visited;
        best
    }

    /// The previous implementation of one level of the descent: a scan of
    /// the children (the oracle of the index's tests).
    #[cfg(test)]
    pub(crate) fn idlest_child_scan(
        &self,
        node: crate::topology::NodeId,
        align: crate::alloc::Align,
        demand: u32,
    ) -> Option<crate::topology::NodeId> {
        let skip_busy = self.config.busy_skip;
        let mut best: Option<(usize, u128, u64)> = None;
        for &c in self.topo.children(node) {
            let a = self.agg(c);
            if a.max_room[align.index()] < demand || (skip_busy && self.busy.is_busy(c)) {
                continue;
            }
            let share = fixed_share(a.sum_free, a.capacity.max(1));
            if best.is_none_or(|b| (share, a.sum_free) > (b.1, b.2)) {
                best = Some((c, share, a.sum_free));
            }
        }
        best.map(|b| b.0)
    }

    /// The leaf with the least runnable demand per capacity, by descent on
    /// the aggregates; leaves of capacity 0 only when all are.
    fn least_loaded(&self) -> LeafId {
        let mut node = self.topo.root();
        loop {
            let children = self.topo.children(node);
            if children.is_empty() {
                return node;
            }
            node = *children
                .iter()
                .min_by_key(|&&c| {
                    let a = self.agg(c);
                    if a.capacity == 0 {
                        u128::MAX
                    } else {
                        fixed_share(a.nr_running, a.capacity)
                    }
                })
                .unwrap_or(&children[0]);
        }
    }

    /// True while the pack policy applies (seed 002): load below the
    /// threshold.
    pub fn pack_active(&self, demand: u32) -> bool {
        debug_assert!(self.agg_pending.is_empty(), "aggregates read stale");
        let root = self.agg(self.topo.root());
        match self.config.pack_threshold {
            PackThreshold::Cores => root.nr_running < self.topo.cores().len() as u64,
            PackThreshold::Fraction(f) => {
                (root.nr_running + demand as u64) as f64 <= f * root.capacity as f64
            }
        }
    }

    /// The pack policy's step that comes first on every placement path
    /// (seed 002): a `Pack` task, while packing is active, goes to
    /// [`Sched::pack_target`] (`prefer` within its core), counted in
    /// `pack_placed`; `None` leaves the task to the path's own search.
    pub(crate) fn pack_first(&mut self, id: TaskId, prefer: Option<LeafId>) -> Option<LeafId> {
        let task = self.tasks.get(&id)?;
        if task.policy != Policy::Pack || !self.pack_active(task.demand) {
            return None;
        }
        let leaf = self.pack_target(id, prefer)?;
        self.stats.pack_placed += 1;
        Some(leaf)
    }

    /// The leaf of the highest-priority (lowest-numbered) core with room;
    /// within that core, `prefer` if it has room, so that a task never
    /// moves between the thread groups of one core.
    ///
    /// Brings the aggregates and the packing index up to date first (the
    /// index notes room changes and is read only here).
    pub fn pack_target(&mut self, id: TaskId, prefer: Option<LeafId>) -> Option<LeafId> {
        self.flush_aggregates();
        let rqs = &self.rqs;
        self.pack.flush(|leaf| rqs[leaf].fit_free());
        let task = self.tasks.get(&id)?;
        let mut from = 0;
        loop {
            let (pos, leaf) = self.pack.first_fit_from(task.demand, from)?;
            if self.fits(id, leaf) {
                if let Some(p) = prefer
                    && self.topo.core_of(p) == self.topo.core_of(leaf)
                    && self.fits(id, p)
                {
                    return Some(p);
                }
                return Some(leaf);
            }
            from = pos + 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use proptest::prelude::*;

    use super::*;
    use crate::config::SchedConfig;
    use crate::task::TaskSpec;
    use crate::topology::Topology;

    const TOPOLOGIES: &[&str] = &["1s:2c:2t", "2s:4c:1t:llc=2", "2z:2r:3n", "2z:2r:4n:2h"];
    const TASKS: usize = 12;

    /// The oracle: what the schedstats moved by one placement says it was
    /// (the way callers explained placements before `Placement`).
    fn from_stats(b: &crate::Schedstats, a: &crate::Schedstats) -> Placement {
        let wake = if a.wake_wide > b.wake_wide {
            WakeChoice::Wide
        } else if a.wake_affine > b.wake_affine {
            WakeChoice::Affine
        } else {
            WakeChoice::None
        };
        let busy = a.busy_skip > b.busy_skip;
        let path = if a.pack_placed > b.pack_placed {
            PlacePath::Pack
        } else if a.find_idlest > b.find_idlest {
            if busy {
                PlacePath::IdlestBusySkip
            } else {
                PlacePath::Idlest
            }
        } else if a.sis_easy > b.sis_easy {
            PlacePath::Target
        } else if a.sis_core > b.sis_core {
            PlacePath::IdleCore
        } else if a.sis_cpu > b.sis_cpu {
            PlacePath::IdleLeaf
        } else if busy {
            PlacePath::BusySkip
        } else {
            PlacePath::NoneIdle
        };
        Placement { wake, path }
    }

    /// Place tasks by `ops` (task, waker, sync; a runnable task is blocked
    /// instead), comparing each `Placement` with the oracle; returns the
    /// paths taken.
    fn run(
        topo: &str,
        pack: bool,
        busy_skip: bool,
        ops: &[(usize, Option<usize>, bool)],
    ) -> Result<Vec<PlacePath>, String> {
        let t = Arc::new(Topology::from_spec(topo).unwrap());
        let config = SchedConfig {
            busy_skip,
            ..SchedConfig::default()
        };
        let mut s = Sched::new(t, 1, config);
        for i in 0..TASKS {
            let mut spec = TaskSpec::new(TaskId(i as u64));
            spec.policy = pack.then_some(Policy::Pack);
            spec.demand = 1 + (i % 2) as u32;
            s.add_task(spec).unwrap();
        }
        let mut paths = Vec::new();
        for (step, &(task, waker, sync)) in ops.iter().enumerate() {
            let now = step as u64 * 1_000_000;
            // Ticks set the busy flags (lazily, as in seed 003).
            for leaf in 0..s.topology().nr_leaves() {
                s.tick(leaf, now);
            }
            let id = TaskId(task as u64);
            if s.task(id).unwrap().state != TaskState::Sleeping {
                s.block(id, now).unwrap();
                continue;
            }
            let waker = waker.map(|w| TaskId(w as u64));
            let before = *s.stats();
            let (leaf, how) = s.select_task_rq_placed(id, waker, sync, now);
            let mut want = from_stats(&before, s.stats());
            if how.wake == WakeChoice::Prev {
                // Keeping prev moves no counter.
                want.wake = WakeChoice::Prev;
            }
            if how != want {
                return Err(format!("step {step}: {how:?}, the schedstats say {want:?}"));
            }
            paths.push(how.path);
            s.wake_up_on(id, leaf, now).unwrap();
        }
        Ok(paths)
    }

    proptest! {
        #[test]
        fn placement_agrees_with_the_schedstats_it_moved(
            topo in prop::sample::select(TOPOLOGIES),
            pack in any::<bool>(),
            busy_skip in any::<bool>(),
            ops in prop::collection::vec(
                (0..TASKS, prop::option::of(0..TASKS), any::<bool>()), 1..60),
        ) {
            run(topo, pack, busy_skip, &ops).map_err(TestCaseError::fail)?;
        }
    }

    /// The random runs above take every path (so the comparison is not
    /// vacuous for any of them).
    #[test]
    fn every_placement_path_is_exercised() {
        let mut seen = std::collections::HashSet::new();
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = |n: usize| {
            // xorshift64, seeded: reproducible.
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % n as u64) as usize
        };
        for round in 0..400 {
            let ops: Vec<_> = (0..60)
                .map(|_| {
                    let waker = (next(3) > 0).then(|| next(TASKS));
                    (next(TASKS), waker, next(2) == 0)
                })
                .collect();
            let topo = TOPOLOGIES[round % TOPOLOGIES.len()];
            let paths = run(topo, round % 5 == 0, round % 2 == 0, &ops).unwrap();
            seen.extend(paths);
        }
        for p in [
            PlacePath::Pack,
            PlacePath::Target,
            PlacePath::IdleCore,
            PlacePath::IdleLeaf,
            PlacePath::NoneIdle,
            PlacePath::BusySkip,
            PlacePath::Idlest,
        ] {
            assert!(seen.contains(&p), "{p:?} never taken: {seen:?}");
        }
    }

    proptest! {
        /// The u64 fast path of the fixed-point share equals the 128-bit
        /// division it replaces, around the 32-bit boundary too.
        #[test]
        fn fixed_share_is_the_128_bit_division(
            num in prop_oneof![0u64..=u32::MAX as u64, any::<u64>(), (u32::MAX as u64 - 4)..(u32::MAX as u64 + 4)],
            den in 1u64..,
        ) {
            prop_assert_eq!(fixed_share(num, den), ((num as u128) << 32) / den as u128);
        }
    }
}
