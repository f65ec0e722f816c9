//! Overload masks: one sparse bitmap per LLC-level domain (cluster: per
//! rack) of the leaves whose runnable demand exceeds their capacity
//! (seed 000 patches 3-4, `cfs_overload_cpus`); with backfill on
//! ([`crate::SchedConfig::backfill`]) also of the leaves whose waiting work
//! cannot start now (a head blocked by alignment or behind a reservation).
//!
//! Element numbers are a leaf's position inside its LLC
//! ([`Topology::llc_pos`]) rather than a global id: the kernel sizes every
//! mask for all CPUs, which at 100,000 nodes would cost ~800 KB per rack.
//! The engine sets a bit on the transition to overloaded and clears it on
//! the transition back, whatever caused it (one task, or a bulk change of
//! runnable demand or capacity, like the seed's throttle/unthrottle).
//!
//! Beside the masks, the number of overloaded leaves in all of them, so
//! that a search finds "nothing to steal anywhere" in O(1) instead of
//! reading every rack's mask (at cluster scale every finish goes newidle).
//!
//! And per LLC, the demands of every task waiting on its leaves
//! ([`LlcDemands`]): a steal search skips a whole LLC none of whose waiting
//! tasks is small enough to start on the stealer, counting its overloaded
//! leaves as visited, instead of visiting each one. The same per sibling
//! group (the LLCs of one parent domain, [`Topology::llc_siblings`]), with
//! the group's number of overloaded leaves, so that the cross-LLC level is
//! skipped whole in O(1) (a zone of 100 racks at cluster scale).

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::rq::DemandSet;
use crate::sparsemask::AtomicSparseMask;
use crate::topology::{LeafId, Topology};

/// The per-LLC masks.
#[derive(Debug)]
pub struct OverloadMasks {
    masks: Vec<AtomicSparseMask>,
    /// Set elements over all masks (changed only by a bit that changed).
    total: AtomicUsize,
    /// Per LLC, set elements of its mask (kept like `total`, so that a
    /// search that skips an LLC counts its leaves in O(1), not by
    /// reading the mask's chunks).
    llc_total: Vec<AtomicUsize>,
    /// Per LLC, its sibling group (the group's first LLC).
    group: Vec<usize>,
    /// Per sibling group (indexed by its first LLC), set elements over
    /// its LLCs' masks.
    group_total: Vec<AtomicUsize>,
}

/// The sibling group of every LLC of `topo`: the first LLC of its
/// sibling list (the lists partition the LLCs).
fn groups(topo: &Topology) -> Vec<usize> {
    (0..topo.llcs().len())
        .map(|l| topo.llc_siblings(l).first().copied().unwrap_or(l))
        .collect()
}

impl OverloadMasks {
    /// Empty masks for every LLC of `topo`.
    pub fn new(topo: &Topology) -> Self {
        Self {
            masks: topo
                .llcs()
                .iter()
                .map(|llc| AtomicSparseMask::new(llc.members.len()))
                .collect(),
            total: AtomicUsize::new(0),
            llc_total: topo.llcs().iter().map(|_| AtomicUsize::new(0)).collect(),
            group: groups(topo),
            group_total: topo.llcs().iter().map(|_| AtomicUsize::new(0)).collect(),
        }
    }

    /// `overload_set`: mark a leaf overloaded.
    pub fn overload_set(&self, topo: &Topology, leaf: LeafId) {
        let llc = topo.llc_of(leaf);
        if !self.masks[llc].test_and_set_elem(topo.llc_pos(leaf)) {
            self.total.fetch_add(1, Ordering::Relaxed);
            self.llc_total[llc].fetch_add(1, Ordering::Relaxed);
            self.group_total[self.group[llc]].fetch_add(1, Ordering::Relaxed);
        }
    }

    /// `overload_clear`: mark a leaf not overloaded.
    pub fn overload_clear(&self, topo: &Topology, leaf: LeafId) {
        let llc = topo.llc_of(leaf);
        if self.masks[llc].test_and_clear_elem(topo.llc_pos(leaf)) {
            self.total.fetch_sub(1, Ordering::Relaxed);
            self.llc_total[llc].fetch_sub(1, Ordering::Relaxed);
            self.group_total[self.group[llc]].fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Number of overloaded leaves in all masks.
    pub fn total(&self) -> usize {
        self.total.load(Ordering::Relaxed)
    }

    /// True when the leaf's bit is set.
    pub fn test(&self, topo: &Topology, leaf: LeafId) -> bool {
        self.masks[topo.llc_of(leaf)].test_elem(topo.llc_pos(leaf))
    }

    /// The mask of one LLC.
    pub fn mask(&self, llc: usize) -> &AtomicSparseMask {
        &self.masks[llc]
    }

    /// Number of overloaded leaves in one LLC (kept, O(1)).
    pub fn weight(&self, llc: usize) -> usize {
        self.llc_total[llc].load(Ordering::Relaxed)
    }

    /// Number of overloaded leaves in the LLCs of `llc`'s sibling group
    /// (`llc` included).
    pub fn group_weight(&self, llc: usize) -> usize {
        self.group_total[self.group[llc]].load(Ordering::Relaxed)
    }

    /// Overloaded leaves of one LLC, from `start` (a position) with
    /// wrap-around (`for_each_sparse_wrap`).
    pub fn iter_wrap<'a>(
        &'a self,
        topo: &'a Topology,
        llc: usize,
        start: usize,
    ) -> impl Iterator<Item = LeafId> + 'a {
        let members = &topo.llcs()[llc].members;
        self.masks[llc]
            .iter_wrap(start)
            .map(move |pos| members[pos])
    }
}

/// Per LLC, the demands of the tasks waiting on its leaves (their fair
/// timelines) and of those in their latency timelines: the union of the
/// leaves' [`crate::rq::RunQueue::wait_demands`] and
/// [`crate::rq::RunQueue::latency_demands`], kept by the engine wherever it
/// changes a timeline.
#[derive(Clone, Debug, Default)]
pub struct LlcDemands {
    wait: Vec<DemandSet>,
    latency: Vec<DemandSet>,
    /// Per LLC, its sibling group (the group's first LLC).
    group: Vec<usize>,
    /// Per sibling group (indexed by its first LLC), the union of its
    /// LLCs' `wait`.
    group_wait: Vec<DemandSet>,
    /// The same for `latency`.
    group_latency: Vec<DemandSet>,
}

impl LlcDemands {
    /// Empty sets for every LLC of `topo`.
    pub fn new(topo: &Topology) -> Self {
        let n = topo.llcs().len();
        Self {
            wait: vec![DemandSet::default(); n],
            latency: vec![DemandSet::default(); n],
            group: groups(topo),
            group_wait: vec![DemandSet::default(); n],
            group_latency: vec![DemandSet::default(); n],
        }
    }

    /// A task of `demand` starts waiting in an LLC.
    pub(crate) fn wait_insert(&mut self, llc: usize, demand: u32) {
        self.wait[llc].insert(demand);
        self.group_wait[self.group[llc]].insert(demand);
    }

    /// A task of `demand` stops waiting in an LLC.
    pub(crate) fn wait_remove(&mut self, llc: usize, demand: u32) {
        self.wait[llc].remove(demand);
        self.group_wait[self.group[llc]].remove(demand);
    }

    /// A task of `demand` enters a latency timeline of an LLC.
    pub(crate) fn latency_insert(&mut self, llc: usize, demand: u32) {
        self.latency[llc].insert(demand);
        self.group_latency[self.group[llc]].insert(demand);
    }

    /// A task of `demand` leaves a latency timeline of an LLC.
    pub(crate) fn latency_remove(&mut self, llc: usize, demand: u32) {
        self.latency[llc].remove(demand);
        self.group_latency[self.group[llc]].remove(demand);
    }

    /// Demands of the tasks waiting in the LLCs of `llc`'s sibling group
    /// (`llc` included).
    pub fn group_wait(&self, llc: usize) -> &DemandSet {
        &self.group_wait[self.group[llc]]
    }

    /// Demands of the tasks in the latency timelines of `llc`'s sibling
    /// group (`llc` included).
    pub fn group_latency(&self, llc: usize) -> &DemandSet {
        &self.group_latency[self.group[llc]]
    }

    /// Demands of the tasks waiting in an LLC.
    pub fn wait(&self, llc: usize) -> &DemandSet {
        &self.wait[llc]
    }

    /// Demands of the tasks in an LLC's latency timelines.
    pub fn latency(&self, llc: usize) -> &DemandSet {
        &self.latency[llc]
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// The running total is the masks' weights summed (the oracle),
        /// each LLC's kept weight its mask's counted one, and each
        /// sibling group's total its LLCs' weights summed, whatever the
        /// order of sets and clears, repeated or not.
        #[test]
        fn total_is_the_sum_of_the_weights(
            ops in prop::collection::vec((any::<bool>(), 0usize..48), 1..200),
        ) {
            let topo = Topology::from_spec("2z:3r:8n").unwrap();
            let masks = OverloadMasks::new(&topo);
            for (set, leaf) in ops {
                if set {
                    masks.overload_set(&topo, leaf);
                } else {
                    masks.overload_clear(&topo, leaf);
                }
                let sum: usize = (0..topo.llcs().len()).map(|l| masks.mask(l).weight()).sum();
                prop_assert_eq!(masks.total(), sum);
                for l in 0..topo.llcs().len() {
                    prop_assert_eq!(masks.weight(l), masks.mask(l).weight());
                }
                for l in 0..topo.llcs().len() {
                    let group: usize =
                        topo.llc_siblings(l).iter().map(|&x| masks.weight(x)).sum();
                    prop_assert_eq!(masks.group_weight(l), group);
                }
            }
        }
    }
}
