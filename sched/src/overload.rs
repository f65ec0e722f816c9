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

use crate::sparsemask::AtomicSparseMask;
use crate::topology::{LeafId, Topology};

/// The per-LLC masks.
#[derive(Debug)]
pub struct OverloadMasks {
    masks: Vec<AtomicSparseMask>,
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
        }
    }

    /// `overload_set`: mark a leaf overloaded.
    pub fn overload_set(&self, topo: &Topology, leaf: LeafId) {
        self.masks[topo.llc_of(leaf)].set_elem(topo.llc_pos(leaf));
    }

    /// `overload_clear`: mark a leaf not overloaded.
    pub fn overload_clear(&self, topo: &Topology, leaf: LeafId) {
        self.masks[topo.llc_of(leaf)].clear_elem(topo.llc_pos(leaf));
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
