//! Asymmetric packing (seed 002): priorities at core granularity and the
//! index that finds the highest-priority leaf with room.
//!
//! Priority follows `-cpu / threads_per_core` in the seed: the lower a
//! core's number, the higher its priority, and all hardware threads of one
//! core share it, so packing never moves a task between the thread groups
//! of one core. Cores are ranked by their lowest leaf id
//! ([`Topology::cores`]). In the dispatcher a "core" is a host group, or a
//! node when there is no host-group level.
//!
//! [`PackIndex`] is a max segment tree over the leaves in priority order
//! holding each leaf's free capacity, so "first leaf in priority order with
//! `free >= demand`" costs O(log n) at 100,000 nodes instead of a scan.

use crate::topology::{LeafId, Topology};

/// Leaves in packing-priority order with a max segment tree of free room.
#[derive(Clone, Debug)]
pub struct PackIndex {
    order: Vec<LeafId>,
    pos: Vec<usize>,
    size: usize,
    tree: Vec<u32>,
}

impl PackIndex {
    /// Index over `topo` with every leaf's room 0.
    pub fn new(topo: &Topology) -> Self {
        let mut order = Vec::with_capacity(topo.nr_leaves());
        for core in topo.cores() {
            order.extend_from_slice(core);
        }
        let mut pos = vec![0; order.len()];
        for (i, &l) in order.iter().enumerate() {
            pos[l] = i;
        }
        let size = order.len().next_power_of_two();
        Self {
            order,
            pos,
            size,
            tree: vec![0; 2 * size],
        }
    }

    /// The packing priority rank of a leaf's core: lower packs first.
    pub fn core_rank(topo: &Topology, leaf: LeafId) -> usize {
        topo.core_of(leaf)
    }

    /// Set a leaf's room.
    pub fn update(&mut self, leaf: LeafId, room: u32) {
        let mut i = self.size + self.pos[leaf];
        self.tree[i] = room;
        while i > 1 {
            i /= 2;
            self.tree[i] = self.tree[2 * i].max(self.tree[2 * i + 1]);
        }
    }

    /// The first leaf in priority order, at or after priority position
    /// `from`, whose room is at least `demand`.
    pub fn first_fit_from(&self, demand: u32, from: usize) -> Option<(usize, LeafId)> {
        if from >= self.order.len() {
            return None;
        }
        self.descend(1, 0, self.size, demand, from)
            .map(|p| (p, self.order[p]))
    }

    fn descend(
        &self,
        node: usize,
        lo: usize,
        hi: usize,
        demand: u32,
        from: usize,
    ) -> Option<usize> {
        if hi <= from || self.tree[node] < demand {
            return None;
        }
        if hi - lo == 1 {
            return (lo < self.order.len()).then_some(lo);
        }
        let mid = (lo + hi) / 2;
        self.descend(2 * node, lo, mid, demand, from)
            .or_else(|| self.descend(2 * node + 1, mid, hi, demand, from))
    }

    /// Priority position of a leaf.
    pub fn position(&self, leaf: LeafId) -> usize {
        self.pos[leaf]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_fit_follows_core_rank() {
        let t = Topology::from_spec("1s:4c:2t").unwrap();
        let mut p = PackIndex::new(&t);
        // Core 0 = {0,4}, core 1 = {1,5}, ...
        assert_eq!(p.first_fit_from(1, 0), None);
        p.update(5, 1);
        p.update(6, 1);
        assert_eq!(p.first_fit_from(1, 0), Some((p.position(5), 5)));
        p.update(0, 1);
        assert_eq!(p.first_fit_from(1, 0), Some((0, 0)));
        assert_eq!(p.first_fit_from(2, 0), None);
        assert_eq!(p.first_fit_from(1, 1).map(|x| x.1), Some(5));
    }
}
