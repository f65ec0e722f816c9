//! Smart wake-affine (seed 001, the merged form): `record_wakee` counts a
//! task's `wakee_flips`, wiped once a second, and `wake_wide` stops pulling
//! a wakee to its waker when the waker fans out to many wakees.
//!
//! The cluster form (the dispatcher's jobs): a waker there is a job or a
//! user's identity that outlives any engine task, so its flip record
//! ([`WakeeFlips`]) is kept by the caller, wiped on the caller's time
//! scale, and handed to [`Sched::select_task_rq_outer`] as an
//! [`OuterWaker`]. A new job has no wakee history of its own (the kernel's
//! second partner), so the cluster test is one-sided: wide when the waker
//! switched wakees more often than its rack holds such jobs
//! ([`wake_wide_outer`]); wide jobs take the fork path, the kernel's
//! `sched_balance_find_dst_group` descent from the waker's zone with the
//! `imbalance_pct` bias toward the waker's own group
//! ([`Sched::find_idlest_from`]); the others go affine, to the waker's rack.

use crate::sched::Sched;
use crate::select::{PlacePath, Placement, WakeChoice};
use crate::task::{Task, TaskId};
use crate::topology::{DomainFlags, LeafId, NodeId};

/// Wipe period of `wakee_flips` (the seed's `HZ` jiffies: one second).
pub const WAKEE_FLIP_DECAY: u64 = 1_000_000_000;

/// `imbalance_pct` of the kernel's domains above the SMT level (117): the
/// waker's group keeps a forked task unless the idlest group is that much
/// less loaded.
pub const IMBALANCE_PCT: u64 = 117;

/// The seed's rough decay: wipe once `period` has passed since the last
/// wipe, then count a flip when the wakee differs from the last one.
fn record_flip(
    last: &mut Option<u64>,
    flips: &mut u32,
    decay_ts: &mut u64,
    wakee: u64,
    now: u64,
    period: u64,
) {
    if now > decay_ts.saturating_add(period) {
        *flips = 0;
        *decay_ts = now;
    }
    if *last != Some(wakee) {
        *last = Some(wakee);
        *flips = flips.saturating_add(1);
    }
}

/// `record_wakee`: the waker (`current`) wakes `wakee_id` at `now`.
pub fn record_wakee(waker: &mut Task, wakee_id: TaskId, now: u64) {
    // Rough decay (wiping) for cost saving, as in the seed.
    let mut last = waker.last_wakee.map(|t| t.0);
    record_flip(
        &mut last,
        &mut waker.wakee_flips,
        &mut waker.wakee_flip_decay_ts,
        wakee_id.0,
        now,
        WAKEE_FLIP_DECAY,
    );
    waker.last_wakee = last.map(TaskId);
}

/// `wake_wide`: true when `wakee.flips > factor && waker.flips > factor *
/// wakee.flips`, with `factor` = `sd_llc_size` of the waker's leaf
/// (cluster: nodes per rack). Then the wakee is spread, not pulled.
pub fn wake_wide(wakee: &Task, waker: &Task, factor: usize) -> bool {
    let factor = factor as u64;
    let wakee_flips = wakee.wakee_flips as u64;
    wakee_flips > factor && waker.wakee_flips as u64 > factor * wakee_flips
}

/// The seed's three per-task fields, kept by a caller whose wakers are
/// not engine tasks (the dispatcher's jobs and users): the last wakee, the
/// flips since the last wipe, the wipe's clock.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WakeeFlips {
    /// The wakee this waker last woke (`last_wakee`).
    pub last_wakee: Option<u64>,
    /// Wakee switches since the last wipe (`wakee_flips`).
    pub flips: u32,
    /// Clock of the last wipe (`wakee_flip_decay_ts`).
    pub decay_ts: u64,
}

impl WakeeFlips {
    /// `record_wakee` with the caller's wipe `period` (same clock as `now`).
    pub fn record(&mut self, wakee: u64, now: u64, period: u64) {
        record_flip(
            &mut self.last_wakee,
            &mut self.flips,
            &mut self.decay_ts,
            wakee,
            now,
            period,
        );
    }

    /// The flips as of `now`: 0 once the record is due for a wipe (what
    /// the next `record` would start from).
    pub fn current(&self, now: u64, period: u64) -> u32 {
        if now > self.decay_ts.saturating_add(period) {
            0
        } else {
            self.flips
        }
    }
}

/// A waker the engine does not hold as a task: where it is (its leaf) and
/// its flip record's count, already decayed by the caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OuterWaker {
    /// The waker's leaf (cluster: the waker job's node, or where the
    /// identity's last wakee went).
    pub leaf: LeafId,
    /// Its `wakee_flips` (the wakee being placed already counted).
    pub flips: u32,
    /// Free capacity of its LLC when its flips last started from zero
    /// (the caller's snapshot, [`Sched::llc_free`]): the room the burst
    /// of wakees found; None = the room now.
    pub room: Option<u64>,
}

/// `wake_wide` for a new task of an outer waker: the waker switched
/// wakees more often than its LLC holds such tasks (`factor`, from
/// [`Sched::wake_wide_factor`]). The kernel's wakee test has no cluster
/// counterpart for a job that is new (it has woken nothing), so it is
/// dropped, and with it the `factor *` on the waker's side.
pub fn wake_wide_outer(waker_flips: u32, factor: usize) -> bool {
    waker_flips as u64 > factor as u64
}

impl Sched {
    /// The wake_wide factor of a task woken by a waker on `leaf`: how many
    /// tasks of its demand the waker's LLC (cluster: rack) has room for now,
    /// at least 1 (the kernel's `sd_llc_size` counts the leaves of an LLC,
    /// each of which holds one task; a cluster leaf holds several, and some
    /// are in use).
    pub fn wake_wide_factor(&self, id: TaskId, leaf: LeafId) -> usize {
        self.wake_wide_factor_in(id, self.llc_free(leaf))
    }

    /// [`Sched::wake_wide_factor`] for an LLC with `room` free capacity.
    pub fn wake_wide_factor_in(&self, id: TaskId, room: u64) -> usize {
        let demand = self.tasks.get(&id).map_or(1, |t| t.demand.max(1)) as u64;
        (room / demand).max(1) as usize
    }

    /// Free capacity (room for newcomers) of `leaf`'s LLC; 0 for a leaf
    /// out of range.
    pub fn llc_free(&self, leaf: LeafId) -> u64 {
        debug_assert!(self.agg_pending.is_empty(), "aggregates read stale");
        if leaf >= self.topo.nr_leaves() {
            return 0;
        }
        self.agg(self.topo.sd_llc(leaf)).sum_free
    }

    /// `select_task_rq` for a new task whose waker the caller keeps
    /// ([`OuterWaker`]): the pack policy first, as for any task; then
    /// `wake_wide` ([`wake_wide_outer`]) sends it down the fork path from
    /// the waker's zone ([`Sched::find_idlest_from`]), else it goes affine:
    /// `select_idle_sibling` in the waker's LLC, and the fork path when
    /// that LLC has no room (a new task has no previous leaf to fall back
    /// on, and the kernel forks new tasks through `find_idlest` anyway).
    /// Counts `wake_wide` / `wake_affine` like `select_task_rq`.
    pub fn select_task_rq_outer(&mut self, id: TaskId, waker: OuterWaker) -> (LeafId, Placement) {
        self.flush_aggregates();
        let mut how = Placement::default();
        let Some(task) = self.tasks.get(&id) else {
            return (0, how);
        };
        let prev = task.prev_leaf;
        if waker.leaf >= self.topo.nr_leaves() {
            let (leaf, path) = self.find_idlest_placed(id);
            how.path = path;
            return (leaf, how);
        }
        if let Some(leaf) = self.pack_first(id, prev.or(Some(waker.leaf))) {
            how.path = PlacePath::Pack;
            return (leaf, how);
        }
        if !self.config.wake_affine {
            let (leaf, path) = self.find_idlest_placed(id);
            how.path = path;
            return (leaf, how);
        }
        let room = waker.room.unwrap_or_else(|| self.llc_free(waker.leaf));
        let wide = self.config.wake_wide
            && wake_wide_outer(waker.flips, self.wake_wide_factor_in(id, room));
        if wide || !self.allowed(id, waker.leaf) {
            if wide {
                self.stats.wake_wide += 1;
                how.wake = WakeChoice::Wide;
            }
            let (leaf, path) = self.find_idlest_from(id, waker.leaf);
            how.path = path;
            return (leaf, how);
        }
        self.stats.wake_affine += 1;
        how.wake = WakeChoice::Affine;
        let (leaf, path) = self.select_idle_sibling_placed(id, waker.leaf, waker.leaf);
        how.path = path;
        if matches!(path, PlacePath::NoneIdle | PlacePath::BusySkip) {
            let (leaf, path) = self.find_idlest_from(id, waker.leaf);
            how.path = path;
            return (leaf, how);
        }
        (leaf, how)
    }

    /// A new task whose only relation to `from` is who submitted it: the
    /// kernel's fork/exec balancing (`select_task_rq_fair` with
    /// `SD_BALANCE_FORK`: no `wake_affine`, no `wake_wide`, the slowest
    /// path from the parent's CPU), [`Sched::find_idlest_from`] from
    /// `from`'s zone; the pack policy first, as on every path.
    pub fn select_task_rq_fork(&mut self, id: TaskId, from: LeafId) -> (LeafId, Placement) {
        self.flush_aggregates();
        let mut how = Placement::default();
        let Some(task) = self.tasks.get(&id) else {
            return (0, how);
        };
        let prev = task.prev_leaf;
        if let Some(leaf) = self.pack_first(id, prev.or(Some(from))) {
            how.path = PlacePath::Pack;
            return (leaf, how);
        }
        let (leaf, path) = self.find_idlest_from(id, from);
        how.path = path;
        (leaf, how)
    }

    /// The fork path from `from`'s zone (NUMA domain), the kernel's
    /// `sched_balance_find_dst_group` at each level: the idlest child with
    /// room (most free capacity per capacity), except that the child
    /// holding `from` keeps the task unless `100 x its load > imbalance_pct
    /// x the idlest's load` (load = capacity in use / capacity); at the
    /// last level the idlest leaf (`sched_balance_find_dst_cpu`), in
    /// `find_idlest`'s order and from its index (the most free per
    /// capacity, then the most free, then the first). Falls
    /// back to [`Sched::find_idlest`] over the whole tree when the zone has
    /// no room for the task, or when the task's affinity is constrained.
    pub fn find_idlest_from(&mut self, id: TaskId, from: LeafId) -> (LeafId, PlacePath) {
        self.flush_aggregates();
        let Some(task) = self.tasks.get(&id) else {
            return (0, PlacePath::Idlest);
        };
        let (demand, align, constrained) = (task.demand, task.align, task.affinity.is_some());
        if constrained || from >= self.topo.nr_leaves() {
            return self.find_idlest_placed(id);
        }
        let ancestors: Vec<NodeId> = self.topo.ancestors(from).collect();
        let start = ancestors
            .iter()
            .copied()
            .find(|&n| self.topo.node(n).flags().contains(DomainFlags::NUMA))
            .unwrap_or_else(|| self.topo.root());
        let skip_busy = self.config.busy_skip;
        if self.agg(start).max_room[align.index()] < demand
            || (skip_busy && self.busy.is_busy(start))
        {
            return self.find_idlest_placed(id);
        }
        self.stats.find_idlest += 1;
        let mut node = start;
        loop {
            let children = self.topo.children(node);
            if children.is_empty() {
                return (node, PlacePath::Idlest);
            }
            let last_level = children.iter().all(|&c| self.topo.node(c).is_leaf());
            if last_level {
                // The idlest leaf, as `find_idlest` picks a child, from
                // its index, not a scan of the rack's leaves; the holder
                // of `from` has no say here.
                return match self.idlest_child(node, align, demand) {
                    Some(leaf) => (leaf, PlacePath::Idlest),
                    None => self.find_idlest_placed(id),
                };
            }
            let mut best: Option<(NodeId, u128)> = None;
            let mut local: Option<(NodeId, u128)> = None;
            for &c in children {
                self.stats.sis_scanned += 1;
                let a = self.agg(c);
                if a.max_room[align.index()] < demand || (skip_busy && self.busy.is_busy(c)) {
                    continue;
                }
                let free = free_share(a.sum_free, a.capacity);
                if c == from || ancestors.contains(&c) {
                    local = Some((c, free));
                }
                if best.is_none_or(|b| free > b.1) {
                    best = Some((c, free));
                }
            }
            let Some((idlest, idlest_free)) = best else {
                return self.find_idlest_placed(id);
            };
            node = match local {
                Some((l, local_free)) if keep_local(local_free, idlest_free) => l,
                _ => idlest,
            };
        }
    }
}

/// Free capacity per capacity, scaled by 2^32.
fn free_share(sum_free: u64, capacity: u64) -> u128 {
    crate::idlest::fixed_share(sum_free, capacity.max(1))
}

/// The kernel's test for staying local: `100 * local_load <= imbalance_pct
/// * idlest_load`, loads being the used shares (2^32 - free share).
fn keep_local(local_free: u128, idlest_free: u128) -> bool {
    let one = 1u128 << 32;
    let (local_load, idlest_load) = (
        one.saturating_sub(local_free),
        one.saturating_sub(idlest_free),
    );
    100 * local_load <= IMBALANCE_PCT as u128 * idlest_load
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Policy;
    use crate::task::{TaskId, TaskSpec};

    fn task(id: u64) -> Task {
        Task::new(TaskSpec::new(TaskId(id)), Policy::Spread, 6_000_000)
    }

    #[test]
    fn flips_count_switches_and_wipe_each_second() {
        let mut w = task(0);
        record_wakee(&mut w, TaskId(1), 10);
        record_wakee(&mut w, TaskId(1), 20);
        assert_eq!(w.wakee_flips, 1, "same wakee twice is one flip");
        record_wakee(&mut w, TaskId(2), 30);
        record_wakee(&mut w, TaskId(1), 40);
        assert_eq!(w.wakee_flips, 3);
        record_wakee(&mut w, TaskId(2), 2 * WAKEE_FLIP_DECAY);
        assert_eq!(w.wakee_flips, 1, "wiped, then counted");
    }

    #[test]
    fn wide_only_for_fan_out() {
        let mut waker = task(0);
        let mut wakee = task(1);
        wakee.wakee_flips = 5;
        waker.wakee_flips = 100;
        assert!(wake_wide(&wakee, &waker, 4));
        assert!(!wake_wide(&wakee, &waker, 5), "wakee not above factor");
        waker.wakee_flips = 20;
        assert!(!wake_wide(&wakee, &waker, 4), "waker not factor x hotter");
        // 1:1 ping-pong never flips.
        let (mut a, mut b) = (task(10), task(11));
        for t in 0..1000 {
            record_wakee(&mut a, TaskId(11), t);
            record_wakee(&mut b, TaskId(10), t);
        }
        assert!(!wake_wide(&b, &a, 1));
    }

    #[test]
    fn outer_records_wipe_on_their_own_period() {
        let period = 60_000_000_000;
        let mut r = WakeeFlips::default();
        for (i, t) in [(1, 10), (1, 20), (2, 30), (3, 40)] {
            r.record(i, t, period);
        }
        assert_eq!(r.flips, 3, "a repeated wakee is no flip");
        assert_eq!(r.current(period, period), 3, "not due before the period");
        assert_eq!(r.current(period + 11, period), 0, "due after it");
        r.record(4, 2 * WAKEE_FLIP_DECAY, period);
        assert_eq!(r.flips, 4, "the kernel's 1 s is not this record's period");
        r.record(5, period + 11, period);
        assert_eq!(
            (r.flips, r.decay_ts),
            (1, period + 11),
            "wiped, then counted"
        );
    }

    use std::sync::Arc;

    use crate::config::SchedConfig;
    use crate::sched::Sched;
    use crate::topology::Topology;

    /// 2 zones x 2 racks x 4 nodes of 8 slots; tasks 100.. fill nodes.
    fn cluster() -> Sched {
        let t = Arc::new(Topology::from_spec("2z:2r:4n").unwrap());
        let caps = vec![8; t.nr_leaves()];
        Sched::with_capacities(t, &caps, SchedConfig::cluster())
    }

    fn rack(s: &Sched, leaf: LeafId) -> LeafId {
        s.topology().sd_llc_id(leaf)
    }

    /// Fill `leaf` with `slots` slots of running work.
    fn load(s: &mut Sched, leaf: LeafId, slots: u32, next: &mut u64) {
        let mut spec = TaskSpec::new(TaskId(*next));
        *next += 1;
        spec.demand = slots;
        s.add_task(spec).unwrap();
        s.wake_up_on(TaskId(*next - 1), leaf, 0).unwrap();
    }

    fn new_task(s: &mut Sched, id: u64, demand: u32) -> TaskId {
        let mut spec = TaskSpec::new(TaskId(id));
        spec.demand = demand;
        s.add_task(spec).unwrap();
        TaskId(id)
    }

    #[test]
    fn factor_counts_the_jobs_the_wakers_rack_has_room_for() {
        let mut s = cluster();
        let mut next = 100;
        let t = new_task(&mut s, 1, 4);
        assert_eq!(s.wake_wide_factor(t, 0), 32 / 4, "4 empty nodes of 8");
        load(&mut s, 1, 8, &mut next);
        load(&mut s, 2, 6, &mut next);
        assert_eq!(s.wake_wide_factor(t, 0), (32 - 14) / 4);
        for leaf in [0, 2, 3] {
            let free = 8 - s.rq(leaf).nr_running;
            load(&mut s, leaf, free, &mut next);
        }
        assert_eq!(s.wake_wide_factor(t, 0), 1, "a full rack still counts 1");
        assert_eq!(s.wake_wide_factor(t, 5), 8, "another rack");
    }

    #[test]
    fn a_fan_out_beyond_the_rack_goes_wide_a_pipeline_stays_affine() {
        let mut s = cluster();
        let waker = 5;
        // A 1:1 pipeline: one flip; affine, in the waker's rack.
        let t = new_task(&mut s, 1, 2);
        let (leaf, how) = s.select_task_rq_outer(
            t,
            OuterWaker {
                leaf: waker,
                flips: 1,
                room: None,
            },
        );
        assert_eq!(how.wake, WakeChoice::Affine);
        assert_eq!(rack(&s, leaf), rack(&s, waker));
        // A waker that switched wakees more often than its rack holds
        // such jobs (4 nodes x 8 / 2 = 16): wide.
        let t = new_task(&mut s, 2, 2);
        let (_, how) = s.select_task_rq_outer(
            t,
            OuterWaker {
                leaf: waker,
                flips: 17,
                room: None,
            },
        );
        assert_eq!((how.wake, how.path), (WakeChoice::Wide, PlacePath::Idlest));
        assert_eq!(s.stats().wake_wide, 1);
        assert_eq!(s.stats().wake_affine, 1);
        let t = new_task(&mut s, 3, 2);
        let (_, how) = s.select_task_rq_outer(
            t,
            OuterWaker {
                leaf: waker,
                flips: 16,
                room: None,
            },
        );
        assert_eq!(how.wake, WakeChoice::Affine, "not above the factor");
        // The room the burst found (a snapshot) counts, not what its first
        // wakees left.
        let t = new_task(&mut s, 4, 2);
        let w = OuterWaker {
            leaf: waker,
            flips: 17,
            room: Some(64),
        };
        assert_eq!(s.select_task_rq_outer(t, w).1.wake, WakeChoice::Affine);
        let mut off = cluster();
        let mut c = off.config().clone();
        c.wake_wide = false;
        off.set_config(c);
        let t = new_task(&mut off, 2, 2);
        let (_, how) = off.select_task_rq_outer(
            t,
            OuterWaker {
                leaf: waker,
                flips: 99,
                room: None,
            },
        );
        assert_eq!(how.wake, WakeChoice::Affine, "wake_wide switched off");
    }

    #[test]
    fn affine_into_a_full_rack_forks_instead_of_queueing_there() {
        let mut s = cluster();
        let mut next = 100;
        let waker = 0;
        let racks: Vec<LeafId> = (0..16)
            .filter(|&l| rack(&s, l) == rack(&s, waker))
            .collect();
        for &l in &racks {
            load(&mut s, l, 8, &mut next);
        }
        let t = new_task(&mut s, 1, 2);
        let (leaf, how) = s.select_task_rq_outer(
            t,
            OuterWaker {
                leaf: waker,
                flips: 1,
                room: None,
            },
        );
        assert_eq!(
            (how.wake, how.path),
            (WakeChoice::Affine, PlacePath::Idlest)
        );
        assert!(s.fits(t, leaf), "placed where it starts now");
        assert_eq!(
            s.topology().numa_of(leaf),
            s.topology().numa_of(waker),
            "same zone"
        );
    }

    #[test]
    fn the_fork_path_keeps_the_wakers_rack_within_imbalance_pct() {
        let mut s = cluster();
        let mut next = 100;
        let waker = 0;
        let z0: Vec<LeafId> = (0..16)
            .filter(|&l| s.topology().numa_of(l) == s.topology().numa_of(waker))
            .collect();
        let (mine, other): (Vec<LeafId>, Vec<LeafId>) =
            z0.iter().partition(|&&l| rack(&s, l) == rack(&s, waker));
        // The waker's rack 50% used, the other rack of its zone 45%: 50 <=
        // 1.17 x 45, the waker's rack keeps the task.
        for &l in &mine {
            load(&mut s, l, 4, &mut next);
        }
        for (i, &l) in other.iter().enumerate() {
            load(&mut s, l, if i % 2 == 0 { 4 } else { 3 }, &mut next);
        }
        let t = new_task(&mut s, 1, 1);
        let (leaf, how) = s.find_idlest_from(t, waker);
        assert_eq!(how, PlacePath::Idlest);
        assert_eq!(rack(&s, leaf), rack(&s, waker), "kept by the bias");
        // The other zone is empty but never looked at.
        assert_eq!(s.topology().numa_of(leaf), s.topology().numa_of(waker));
        // The waker's rack 75% used: 75 > 1.17 x 45, the idlest rack.
        for &l in &mine {
            load(&mut s, l, 2, &mut next);
        }
        let (leaf, _) = s.find_idlest_from(t, waker);
        assert!(other.contains(&leaf), "{leaf} not in the idler rack");
        assert_eq!(s.rq(leaf).nr_running, 3, "its idlest node");
        // A zone without room: the whole tree.
        for &l in &z0 {
            let free = 8 - s.rq(l).nr_running;
            load(&mut s, l, free, &mut next);
        }
        let (leaf, _) = s.find_idlest_from(t, waker);
        assert_ne!(s.topology().numa_of(leaf), s.topology().numa_of(waker));
    }

    proptest::proptest! {
        /// The fork path's last level, from the index, picks the leaf a
        /// scan of the chosen rack picks in `find_idlest`'s order (the
        /// most free per capacity, then the most free, then the first,
        /// among leaves with room that are not busy): on racks of mixed
        /// capacities, where equal shares of unequal nodes tie on the
        /// share alone, with busy-skip on and off. When the scan finds
        /// no leaf in any rack of the zone, the whole tree's answer.
        #[test]
        fn the_fork_paths_leaf_is_the_scans_choice(
            caps in proptest::collection::vec(proptest::sample::select(vec![4u32, 8, 16]), 16),
            used in proptest::collection::vec(0u32..=16, 16),
            demand in 1u32..=6,
            from in 0usize..16,
            busy_skip in proptest::bool::ANY,
        ) {
            let t = Arc::new(Topology::from_spec("1z:2r:8n").unwrap());
            let mut s = Sched::with_capacities(t, &caps, SchedConfig::cluster());
            let mut c = s.config().clone();
            c.busy_skip = busy_skip;
            s.set_config(c);
            let mut next = 100;
            for (leaf, (&cap, &u)) in caps.iter().zip(&used).enumerate() {
                if u.min(cap) > 0 {
                    load(&mut s, leaf, u.min(cap), &mut next);
                }
            }
            let task = new_task(&mut s, 1, demand);
            let (leaf, _) = s.find_idlest_from(task, from);
            s.flush_aggregates();
            let rack = s.topology().ancestors(leaf).next().unwrap();
            let align = crate::alloc::Align::Any;
            match s.idlest_child_scan(rack, align, demand) {
                Some(want) => proptest::prop_assert_eq!(leaf, want),
                None => {
                    let racks: Vec<NodeId> = (0..16)
                        .filter_map(|l| s.topology().ancestors(l).next())
                        .collect();
                    proptest::prop_assert!(
                        racks
                            .iter()
                            .all(|&r| s.idlest_child_scan(r, align, demand).is_none()),
                        "leaf {} from a rack without room while another has some",
                        leaf
                    );
                }
            }
        }
    }
}
