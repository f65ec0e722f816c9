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
//! leaves as visited, instead of visiting each one.

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
        }
    }

    /// `overload_set`: mark a leaf overloaded.
    pub fn overload_set(&self, topo: &Topology, leaf: LeafId) {
        if !self.masks[topo.llc_of(leaf)].test_and_set_elem(topo.llc_pos(leaf)) {
            self.total.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// `overload_clear`: mark a leaf not overloaded.
    pub fn overload_clear(&self, topo: &Topology, leaf: LeafId) {
        if self.masks[topo.llc_of(leaf)].test_and_clear_elem(topo.llc_pos(leaf)) {
            self.total.fetch_sub(1, Ordering::Relaxed);
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

    /// Number of overloaded leaves in one LLC.
    pub fn weight(&self, llc: usize) -> usize {
        self.masks[llc].weight()
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
}

impl LlcDemands {
    /// Empty sets for every LLC of `topo`.
    pub fn new(topo: &Topology) -> Self {
        let n = topo.llcs().len();
        Self {
            wait: vec![DemandSet::default(); n],
            latency: vec![DemandSet::default(); n],
        }
    }

    /// A task of `demand` starts waiting in an LLC.
    pub(crate) fn wait_insert(&mut self, llc: usize, demand: u32) {
        self.wait[llc].insert(demand);
    }

    /// A task of `demand` stops waiting in an LLC.
    pub(crate) fn wait_remove(&mut self, llc: usize, demand: u32) {
        self.wait[llc].remove(demand);
    }

    /// A task of `demand` enters a latency timeline of an LLC.
    pub(crate) fn latency_insert(&mut self, llc: usize, demand: u32) {
        self.latency[llc].insert(demand);
    }

    /// A task of `demand` leaves a latency timeline of an LLC.
    pub(crate) fn latency_remove(&mut self, llc: usize, demand: u32) {
        self.latency[llc].remove(demand);
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
        /// whatever the order of sets and clears, repeated or not.
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
                let sum: usize = (0..topo.llcs().len()).map(|l| masks.weight(l)).sum();
                prop_assert_eq!(masks.total(), sum);
            }
        }
    }
}
