//! Idle stealing (seed 000 patches 7-9): when a leaf goes idle and the
//! normal path found nothing, take the first migratable waiting task of an
//! overloaded leaf: SMT siblings first "to preserve cache warmth", then the
//! LLC's overload mask from the stealer's own position with wrap-around.
//!
//! Gates, in the seed's order: the STEAL feature; node-limit gating (no
//! stealing when NUMA nodes, cluster: zones, exceed the limit); the
//! stealer's `avg_idle` must be at least the steal cost. A task is
//! migratable (`can_migrate_task_llc`) when it is waiting, not running,
//! and its affinity allows the stealer (and, with capacities, it fits).
//!
//! Beyond the seed, off by default: stealing one level up, from the other
//! LLCs under the LLC's parent domain, through the per-domain list of LLC
//! masks Steve Sistare proposed in the thread ([`Topology::llc_siblings`]).
//!
//! [`Topology::llc_siblings`]: crate::topology::Topology::llc_siblings
//!
//! Stealing is the newly-idle shortcut. [`Sched::idle_balance`] is the
//! analogue of the kernel's periodic / nohz idle balance: a pass, run by the
//! caller on its tick and after every finish, that visits the leaves with
//! room near overloaded leaves and pulls through the same masks in the same
//! order, so that work left waiting by a missed newidle moment (a head that
//! became stealable later, a leaf that gained room without going idle) is
//! not stranded.
//!
//! With backfill ([`crate::SchedConfig::backfill`]) a leaf with spare
//! capacity behind a blocked head steals too, and only tasks that can start
//! on it now without delaying its own head ([`Sched::fits_now`]).
//!
//! Skipping what cannot fit (not in the seeds, same decisions): every test
//! of "fits" needs [`RunQueue::can_start`] on the stealer, so no task larger
//! than its [`RunQueue::start_bound`] can move. A search skips a whole LLC
//! whose waiting tasks ([`crate::overload::LlcDemands`]) are all larger,
//! counting its overloaded leaves as visited (`steal_scanned`) as the walk
//! would, and a source leaf whose waiting tasks
//! ([`RunQueue::wait_demands`]) are all larger, without walking its queue;
//! the latency pull does the same with the latency timelines. The
//! cross-LLC level is skipped whole when the parent domain's sibling group
//! has nothing small enough. At 100,000
//! nodes the full walk visited every overloaded node of a zone and every
//! waiting task of each on every search, to find nothing most of the time.
//!
//! [`RunQueue::can_start`]: crate::rq::RunQueue::can_start
//! [`RunQueue::start_bound`]: crate::rq::RunQueue::start_bound
//! [`RunQueue::wait_demands`]: crate::rq::RunQueue::wait_demands

use std::collections::HashMap;

use crate::sched::Sched;
use crate::task::{TaskId, TaskState};
use crate::topology::{LeafId, NodeId};

impl Sched {
    /// `try_steal`: the idle leaf `dst` takes one waiting task from an
    /// overloaded leaf. Returns the stolen task.
    pub fn try_steal(&mut self, dst: LeafId, now: u64) -> Option<TaskId> {
        if !self.config.steal || !self.can_pull(dst) {
            return None;
        }
        if !self.steal_llc_allowed {
            self.stats.steal_skip_node_limit += 1;
            return None;
        }
        if self.rqs[dst].avg_idle < self.config.steal_cost {
            self.stats.steal_skip_avg_idle += 1;
            return None;
        }
        self.steal_search(dst, now).map(|(p, _)| p)
    }

    /// The search of `try_steal` past its gates: SMT siblings, the LLC
    /// from `dst`'s position with wrap-around, then (if enabled and allowed
    /// by node-limit gating) the sibling LLCs. Within a level the source
    /// is the first overloaded leaf with a task that fits (seed 000) or,
    /// with [`crate::SchedConfig::pull_longest_wait`], the one whose first
    /// such task has waited longest. Returns the task moved and the leaf
    /// it came from.
    fn steal_search(&mut self, dst: LeafId, now: u64) -> Option<(TaskId, LeafId)> {
        if self.overload.total() == 0 {
            // Nothing overloaded anywhere (O(1)): every level below finds
            // no candidate; only the cross-LLC gate counts, as it would.
            if self.config.steal_cross_llc && !self.steal_cross_allowed[self.topo.llc_of(dst)] {
                self.stats.steal_skip_node_limit += 1;
            }
            return None;
        }
        let topo = self.topo.clone();
        let bound = self.skip_bound(dst);
        let mut found_overloaded = false;

        // First try overloaded leaves on the same core, for cache warmth.
        let smt = self.overloaded_smt_siblings(dst);
        if let Some(hit) = self.pull_level(dst, &smt, now, &mut found_overloaded) {
            self.stats.steal_smt += 1;
            return Some(hit);
        }

        // Accept any suitable task in the LLC.
        let llc = topo.llc_of(dst);
        if self.llc_demands.wait(llc).any_within(bound) {
            let candidates = self.overloaded_in_llc(dst);
            if let Some(hit) = self.pull_level(dst, &candidates, now, &mut found_overloaded) {
                return Some(hit);
            }
        } else {
            let n = self.overload.weight(llc) - usize::from(self.overload.test(&topo, dst));
            self.skip_visited(n, &mut found_overloaded);
        }

        // One level up: the other LLCs of the parent domain.
        if self.config.steal_cross_llc {
            if !self.steal_cross_allowed[llc] {
                self.stats.steal_skip_node_limit += 1;
            } else if let Some(hit) =
                self.pull_sibling_llcs(dst, llc, bound, now, &mut found_overloaded)
            {
                self.stats.steal_cross_llc += 1;
                return Some(hit);
            }
        }

        if found_overloaded {
            self.stats.steal_fail += 1;
        }
        None
    }

    /// The search's first level: `dst`'s overloaded SMT siblings (cache
    /// warmth).
    fn overloaded_smt_siblings(&self, dst: LeafId) -> Vec<LeafId> {
        self.topo
            .smt_siblings(dst)
            .iter()
            .copied()
            .filter(|&src| src != dst && self.overload.test(&self.topo, src))
            .collect()
    }

    /// The second level: the overloaded leaves of `dst`'s LLC, from its
    /// position with wrap-around (seed 000's `sd_llc` walk).
    fn overloaded_in_llc(&self, dst: LeafId) -> Vec<LeafId> {
        let topo = &self.topo;
        self.overload
            .iter_wrap(topo, topo.llc_of(dst), topo.llc_pos(dst))
            .filter(|&src| src != dst)
            .collect()
    }

    /// The largest demand a task may have to move to `dst` now
    /// ([`crate::rq::RunQueue::start_bound`]); `u32::MAX` with the skip
    /// turned off ([`Sched::set_steal_skip`]).
    fn skip_bound(&self, dst: LeafId) -> u32 {
        if self.steal_skip {
            self.rqs[dst].start_bound()
        } else {
            u32::MAX
        }
    }

    /// `n` overloaded leaves skipped as a block: counted as visited, as
    /// the walk that would have found nothing on them counts them.
    fn skip_visited(&mut self, n: usize, found_overloaded: &mut bool) {
        self.stats.steal_scanned += n as u64;
        *found_overloaded |= n > 0;
    }

    /// The other LLCs of `llc`'s parent domain, from the one after `llc`
    /// with wrap-around.
    fn sibling_llcs(&self, llc: usize) -> Vec<usize> {
        let sibs = self.topo.llc_siblings(llc);
        let me = sibs.iter().position(|&x| x == llc).unwrap_or(0);
        (1..sibs.len())
            .map(|i| sibs[(me + i) % sibs.len()])
            .collect()
    }

    /// The overloaded leaves of one LLC from its first position.
    fn overloaded_of(&self, llc: usize) -> Vec<LeafId> {
        self.overload.iter_wrap(&self.topo, llc, 0).collect()
    }

    /// The search's level one up: the overloaded leaves of the other LLCs
    /// of `llc`'s parent domain, LLC by LLC from the one after `llc`, as
    /// one level of [`Sched::pull_level`]; an LLC with no waiting task of
    /// demand `bound` or less is skipped whole.
    fn pull_sibling_llcs(
        &mut self,
        dst: LeafId,
        llc: usize,
        bound: u32,
        now: u64,
        found_overloaded: &mut bool,
    ) -> Option<(TaskId, LeafId)> {
        if !self.llc_demands.group_wait(llc).any_within(bound) {
            // Nothing small enough in the whole parent domain.
            let n = self.overload.group_weight(llc) - self.overload.weight(llc);
            self.skip_visited(n, found_overloaded);
            return None;
        }
        let sibs = self.sibling_llcs(llc);
        if !self.config.pull_longest_wait {
            // The first hit in order: LLC by LLC is the same walk.
            for l in sibs {
                if self.llc_demands.wait(l).any_within(bound) {
                    let candidates = self.overloaded_of(l);
                    if let Some(hit) = self.pull_level(dst, &candidates, now, found_overloaded) {
                        return Some(hit);
                    }
                } else {
                    let n = self.overload.weight(l);
                    self.skip_visited(n, found_overloaded);
                }
            }
            return None;
        }
        // The best over the whole level: every candidate is weighed.
        let mut candidates = Vec::new();
        for l in sibs {
            if self.llc_demands.wait(l).any_within(bound) {
                candidates.extend(self.overload.iter_wrap(&self.topo, l, 0));
            } else {
                let n = self.overload.weight(l);
                self.skip_visited(n, found_overloaded);
            }
        }
        self.pull_level(dst, &candidates, now, found_overloaded)
    }

    /// One level of the search: `candidates` are overloaded leaves in
    /// search order. Seed 000 takes the first with a migratable task;
    /// with `pull_longest_wait` every candidate's first migratable task is
    /// weighed and the one waiting longest (latency class first) moves.
    fn pull_level(
        &mut self,
        dst: LeafId,
        candidates: &[LeafId],
        now: u64,
        found_overloaded: &mut bool,
    ) -> Option<(TaskId, LeafId)> {
        if candidates.is_empty() {
            return None;
        }
        *found_overloaded = true;
        if !self.config.pull_longest_wait {
            for &src in candidates {
                self.stats.steal_scanned += 1;
                if let Some(p) = self.steal_from(dst, src, now) {
                    return Some((p, src));
                }
            }
            return None;
        }
        let mut best: Option<((bool, u64, TaskId), LeafId)> = None;
        for &src in candidates {
            self.stats.steal_scanned += 1;
            if src == dst || !self.leaf_overloaded(src) {
                continue;
            }
            let Some(p) = self.detach_next_task(src, dst, now) else {
                continue;
            };
            let key = self.wait_key(p);
            if best.is_none_or(|(k, _)| key < k) {
                best = Some((key, src));
            }
        }
        let ((_, _, p), src) = best?;
        self.pull_task(p, src, dst, now, false);
        Some((p, src))
    }

    /// Order of pull candidates under `pull_longest_wait`: latency class
    /// (when latency-nice is on) first, then the earliest `queued_at`.
    fn wait_key(&self, p: TaskId) -> (bool, u64, TaskId) {
        match self.tasks.get(&p) {
            Some(t) => (
                !(self.config.latency && t.latency_offset < 0),
                t.queued_at,
                p,
            ),
            None => (true, u64::MAX, p),
        }
    }

    /// `steal_from`: migrate the first migratable waiting task of `src`, in
    /// next-to-run order, to `dst`.
    fn steal_from(&mut self, dst: LeafId, src: LeafId, now: u64) -> Option<TaskId> {
        if dst == src || !self.leaf_overloaded(src) {
            return None;
        }
        let p = self.detach_next_task(src, dst, now)?;
        self.pull_task(p, src, dst, now, false);
        Some(p)
    }

    /// Move the waiting task `p` from `src` to `dst` (a steal, a pull of
    /// the idle-balance pass or a latency pull), start it there, then let
    /// `src` run what its leaving lets run. `p` was chosen because it can
    /// start on `dst` now (as `dst`'s next task, or, with backfill,
    /// without delaying `dst`'s head), so `dst`'s `schedule` would start
    /// it; starting it before `src`'s queue runs means that a task in
    /// flight is never pulled again by a leaf that `src`'s `schedule`
    /// reaches (two leaves could otherwise hand one waiting task back and
    /// forth without end). With `settle_dst`, `dst` runs the rest of its
    /// own queue first too (a latency pull comes before `dst`'s own
    /// tasks, which must not be pulled away from it while they can start
    /// there).
    pub(crate) fn pull_task(
        &mut self,
        p: TaskId,
        src: LeafId,
        dst: LeafId,
        now: u64,
        settle_dst: bool,
    ) {
        self.migrate_queued(p, src, dst, now);
        self.stats.steal += 1;
        // A latency pull was predicted to be `dst`'s next task.
        debug_assert!(!settle_dst || self.next_to_run(dst) == Some(p));
        if self
            .tasks
            .get(&p)
            .is_some_and(|t| self.rqs[dst].can_start(t.demand, t.align))
        {
            self.set_next(p, dst, now);
        }
        if settle_dst {
            self.schedule(dst, now);
        }
        self.schedule(src, now);
    }

    /// `detach_next_task`: the first waiting task of `src`, in next-to-run
    /// order, that may move to `dst`.
    ///
    /// Walked lazily: the search visits every overloaded leaf of a domain,
    /// so materialising each one's whole queue order
    /// ([`Sched::next_to_run_order`]) was most of a large cluster's steal
    /// cost; the order visited is the same.
    ///
    /// A source none of whose waiting tasks is small enough to start on
    /// `dst` ([`crate::rq::RunQueue::start_bound`]) is not walked.
    fn detach_next_task(&self, src: LeafId, dst: LeafId, now: u64) -> Option<TaskId> {
        if !self.rqs[src]
            .wait_demands()
            .any_within(self.skip_bound(dst))
        {
            return None;
        }
        let first = self.pick_next_entity(src)?;
        if self.can_migrate_task_llc(first, src, dst, now) {
            return Some(first);
        }
        // `dst`'s head protected: a task fits there only if it cannot
        // delay it (`fits_now`), so when none of `src`'s waiting demands
        // fits the head's extra room, only a task with an expected end
        // can, and those alone are walked (behind a blocked head, a queue
        // of thousands without a limit was walked on every steal).
        let migrates = |&p: &TaskId| p != first && self.can_migrate_task_llc(p, src, dst, now);
        if let Some(extra) = self.backfill_extra(dst, now)
            && !self.rqs[src].wait_demands().any_within(extra)
        {
            debug_assert!(self.bounded_timeline_holds(src));
            return self.rqs[src].waiting_bounded().find(migrates);
        }
        self.rqs[src].waiting().find(migrates)
    }

    /// `can_migrate_task_llc`: waiting on `src` (never running), allowed on
    /// `dst`, and fitting there now ([`Sched::fits_now`]: with backfill,
    /// without delaying `dst`'s head).
    pub fn can_migrate_task_llc(&self, p: TaskId, src: LeafId, dst: LeafId, now: u64) -> bool {
        let Some(t) = self.tasks.get(&p) else {
            return false;
        };
        t.state == TaskState::Queued(src) && t.allowed(dst) && self.fits_now(dst, p, now)
    }

    /// `latency_pull`: seed 004's latency-first pick over `dst`'s steal
    /// domain ([`crate::SchedConfig::latency_pull`]). While `dst` has
    /// spare capacity, take the latency-sensitive task waiting on an
    /// overloaded leaf of the domain that can start on `dst` now and that
    /// `dst`'s `pick_next_entity` would run first once it waited there
    /// (it leads `dst`'s latency timeline and
    /// `wakeup_preempt_entity(latency, left) < 1` against `dst`'s fair
    /// leftmost, vruntimes made relative as a migration does), and start
    /// it. Levels in seed 000's order (SMT siblings, the LLC from `dst`'s
    /// position, the sibling LLCs when cross-LLC stealing is on and
    /// node-limit gating allows); within a level the lowest latency key
    /// (relative vruntime + offset), then the longest wait. Called by
    /// `schedule` before the leaf's own tasks and before `try_steal`.
    /// Returns the number of tasks started.
    ///
    /// Cost: nothing unless latency-nice, stealing and the switch are on
    /// and `dst` has room; then one visit per overloaded leaf of the
    /// domain, and the latency timeline of those that have one.
    pub fn latency_pull(&mut self, dst: LeafId, now: u64) -> usize {
        let c = &self.config;
        if !(c.latency_pull && c.latency && c.steal && self.steal_llc_allowed) {
            return 0;
        }
        // Every candidate of the search is an overloaded leaf (and all it
        // counts as scanned): with none anywhere it finds and counts
        // nothing.
        if self.overload.total() == 0 && self.shortcuts() {
            return 0;
        }
        let mut started = 0;
        while self.rqs[dst].has_spare() {
            let Some((p, src)) = self.latency_pull_search(dst) else {
                break;
            };
            self.stats.latency_pull += 1;
            self.pull_task(p, src, dst, now, true);
            started += 1;
        }
        started
    }

    /// The search of [`Sched::latency_pull`]: the task to take and where
    /// it waits.
    ///
    /// An LLC none of whose latency timelines holds a task small enough to
    /// start on `dst` is skipped whole (its overloaded leaves counted as
    /// visited), as a source leaf is in [`Sched::latency_pull_level`].
    fn latency_pull_search(&mut self, dst: LeafId) -> Option<(TaskId, LeafId)> {
        // Candidates are walked where they lie (the masks, the sibling
        // lists), never collected: this runs on every start and finish.
        let bound = self.skip_bound(dst);
        let topo = &*self.topo;
        let overload = &self.overload;
        let smt = topo
            .smt_siblings(dst)
            .iter()
            .copied()
            .filter(|&src| src != dst && overload.test(topo, src));
        let (hit, scanned) = self.latency_pull_level(dst, bound, smt);
        self.stats.steal_scanned += scanned;
        if hit.is_some() {
            self.stats.steal_smt += 1;
            return hit;
        }
        let topo = &*self.topo;
        let overload = &self.overload;
        let llc = topo.llc_of(dst);
        if self.llc_demands.latency(llc).any_within(bound) {
            let in_llc = overload
                .iter_wrap(topo, llc, topo.llc_pos(dst))
                .filter(|&src| src != dst);
            let (hit, scanned) = self.latency_pull_level(dst, bound, in_llc);
            self.stats.steal_scanned += scanned;
            if hit.is_some() {
                return hit;
            }
        } else {
            let n = overload.weight(llc) - usize::from(overload.test(topo, dst));
            self.stats.steal_scanned += n as u64;
        }
        if self.config.steal_cross_llc && self.steal_cross_allowed[llc] {
            let topo = &*self.topo;
            let overload = &self.overload;
            if !self.llc_demands.group_latency(llc).any_within(bound) {
                let n = overload.group_weight(llc) - overload.weight(llc);
                self.stats.steal_scanned += n as u64;
                return None;
            }
            // The sibling LLCs from the one after `llc`, with wrap-around
            // ([`Sched::sibling_llcs`]); an LLC without a small enough
            // latency task is skipped whole, its leaves counted as visited.
            let sibs = topo.llc_siblings(llc);
            let me = sibs.iter().position(|&x| x == llc).unwrap_or(0);
            let demands = &self.llc_demands;
            let mut skipped = 0;
            let mut others = (1..sibs.len()).map(|i| sibs[(me + i) % sibs.len()]);
            let mut candidates = std::iter::from_fn(|| {
                for l in others.by_ref() {
                    if demands.latency(l).any_within(bound) {
                        return Some(overload.iter_wrap(topo, l, 0));
                    }
                    skipped += overload.weight(l) as u64;
                }
                None
            })
            .flatten();
            let (hit, scanned) = self.latency_pull_level(dst, bound, &mut candidates);
            drop(candidates);
            self.stats.steal_scanned += scanned + skipped;
            if hit.is_some() {
                self.stats.steal_cross_llc += 1;
            }
            return hit;
        }
        None
    }

    /// One level of [`Sched::latency_pull`]'s search over overloaded
    /// leaves `candidates`: per leaf, the first task of its latency
    /// timeline that may move to `dst`, start there now and go first
    /// there; the best of those by (relative latency key, wait start).
    /// Returns it with the number of candidates visited (for
    /// `steal_scanned`); `bound` is [`Sched::skip_bound`] of `dst`.
    fn latency_pull_level(
        &self,
        dst: LeafId,
        bound: u32,
        candidates: impl Iterator<Item = LeafId>,
    ) -> (Option<(TaskId, LeafId)>, u64) {
        let mut best: Option<((i64, u64, TaskId), LeafId)> = None;
        let mut scanned = 0;
        for src in candidates {
            scanned += 1;
            if src == dst || !self.rqs[src].latency_demands().any_within(bound) {
                continue;
            }
            let shift = self.min_vruntime(dst) - self.min_vruntime(src);
            let found = self.rqs[src].latency_keys().find_map(|&(key, _, p)| {
                let t = self.tasks.get(&p)?;
                let movable = t.state == TaskState::Queued(src)
                    && t.allowed(dst)
                    && self.rqs[dst].can_start(t.demand, t.align)
                    && self.latency_goes_first(t, shift, dst);
                movable.then_some((key + shift, t.queued_at, p))
            });
            if let Some(k) = found
                && best.is_none_or(|(b, _)| k < b)
            {
                best = Some((k, src));
            }
        }
        (best.map(|((_, _, p), src)| (p, src)), scanned)
    }

    /// True when the waiting latency-sensitive task `t`, moved to `dst`
    /// (its vruntime shifted by `shift`), would be `dst`'s
    /// `pick_next_entity`: it would lead `dst`'s latency timeline (it
    /// enters it last, so ties lose) and either lead the fair timeline
    /// too or pass seed 004's test against its leftmost,
    /// `wakeup_preempt_entity(latency, left) < 1`.
    fn latency_goes_first(&self, t: &crate::task::Task, shift: i64, dst: LeafId) -> bool {
        let rq = &self.rqs[dst];
        let vruntime = t.vruntime + shift;
        if rq
            .first_latency()
            .is_some_and(|k| k.0 <= vruntime + t.latency_offset)
        {
            return false;
        }
        let Some(left) = rq.first_fair() else {
            return true;
        };
        if vruntime < left.0 {
            return true;
        }
        let Some(l) = self.tasks.get(&left.2) else {
            return false;
        };
        let mut moved = t.clone();
        moved.vruntime = vruntime;
        self.wakeup_preempt_entity(&moved, l) < 1
    }

    /// `idle_balance`: the periodic / nohz idle balance pass (the kernel's
    /// `nohz_idle_balance` kicking `rebalance_domains` on idle CPUs). For
    /// the caller's tick and every finish. Visits every leaf that may take
    /// work (idle; with backfill, any spare capacity) in a domain where
    /// some leaf is overloaded: its LLC, or, with cross-LLC stealing
    /// allowed by node-limit gating, a sibling LLC of its parent domain.
    /// Each visited leaf pulls, in seed 000's order (SMT siblings, the LLC
    /// from its own position, the sibling LLCs), the first migratable task
    /// that can start on it now, and again while it has room and finds one.
    /// A leaf that lost a waiting task is visited again (its head, and
    /// so its room, may have changed). Unlike the newidle steal it is not
    /// gated by `avg_idle` (the periodic balancer has its own interval: the
    /// caller's tick). Returns the number of tasks moved; 0 when
    /// [`crate::SchedConfig::idle_balance`] is off.
    ///
    /// Cost: O(LLCs) to find the overloaded domains, O(waiting tasks of
    /// overloaded leaves) for the smallest waiting demand per domain, then
    /// an O(1) check per leaf of those domains; only a leaf with at least
    /// that much free capacity is searched. Nothing when no leaf is
    /// overloaded.
    pub fn idle_balance(&mut self, now: u64) -> usize {
        if !self.config.idle_balance || !self.steal_llc_allowed {
            return 0;
        }
        if self.overload.total() == 0 {
            return 0;
        }
        let topo = self.topo.clone();
        let llcs = topo.llcs();
        let overloaded: Vec<bool> = (0..llcs.len())
            .map(|l| !self.overload.mask(l).is_empty())
            .collect();
        if !overloaded.contains(&true) {
            return 0;
        }
        let parent = |l: usize| -> Option<NodeId> { topo.node(llcs[l].node).parent() };
        // The smallest waiting demand per LLC and per parent domain: a
        // leaf with less free capacity than every waiting task of its
        // domain cannot take any, and is not searched. Tasks only leave
        // queues during the pass, so these stay lower bounds.
        let mut min_llc = vec![u32::MAX; llcs.len()];
        let mut min_parent: HashMap<NodeId, u32> = HashMap::new();
        for l in (0..llcs.len()).filter(|&l| overloaded[l]) {
            for src in self.overload.iter_wrap(&topo, l, 0) {
                for id in self.rqs[src].waiting() {
                    if let Some(t) = self.tasks.get(&id) {
                        min_llc[l] = min_llc[l].min(t.demand);
                    }
                }
            }
            if let Some(p) = parent(l) {
                let m = min_parent.entry(p).or_insert(u32::MAX);
                *m = (*m).min(min_llc[l]);
            }
        }
        let mut bound = vec![u32::MAX; llcs.len()];
        let mut work: Vec<LeafId> = Vec::new();
        for l in (0..llcs.len()).rev() {
            bound[l] = min_llc[l];
            if self.config.steal_cross_llc
                && self.steal_cross_allowed[l]
                && let Some(m) = parent(l).and_then(|p| min_parent.get(&p))
            {
                bound[l] = bound[l].min(*m);
            }
            if bound[l] != u32::MAX {
                work.extend(llcs[l].members.iter().rev());
            }
        }
        let mut moved = 0;
        while let Some(dst) = work.pop() {
            moved += self.latency_pull(dst, now);
            while self.can_pull(dst) && self.rqs[dst].free() >= bound[topo.llc_of(dst)] {
                let Some((p, src)) = self.steal_search(dst, now) else {
                    break;
                };
                moved += 1;
                self.schedule(dst, now);
                work.push(src);
                if !matches!(
                    self.tasks.get(&p).map(|t| t.state),
                    Some(TaskState::Running(_))
                ) {
                    break;
                }
            }
        }
        moved
    }

    /// Whether `dst`'s steal search (`try_steal`, `idle_balance`) visits
    /// `src`: `Some(true)` it does, `Some(false)` it would but node-limit
    /// gating (seed 000 patch 9) stops it, `None` it never would (stealing
    /// off, or `src` outside `dst`'s LLC and the enabled sibling LLCs).
    /// For the dispatcher's pending reasons (the node-limit gate).
    pub fn steal_reach(&self, dst: LeafId, src: LeafId) -> Option<bool> {
        if !self.config.steal {
            return None;
        }
        let (a, b) = (self.topo.llc_of(dst), self.topo.llc_of(src));
        if a == b {
            return Some(self.steal_llc_allowed);
        }
        if self.config.steal_cross_llc && self.topo.llc_siblings(a).contains(&b) {
            return Some(self.steal_llc_allowed && self.steal_cross_allowed[a]);
        }
        None
    }
}
