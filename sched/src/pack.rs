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
//! Only pack placements read it, so a leaf's room change is only noted
//! ([`PackIndex::mark`], once per leaf) and the tree is brought up to date
//! when a pack placement next reads it ([`PackIndex::flush`]): an engine
//! that never packs does not pay a climb per change. Once a quarter of
//! the leaves are marked, the flush will rebuild the whole tree anyway:
//! the index stops listing them (`all_stale`), so an engine that never
//! packs does not keep a list of every leaf either (8 bytes per node of a
//! cluster, its construction marks every leaf).

use crate::topology::{LeafId, Topology};

/// Leaves in packing-priority order with a max segment tree of free room.
#[derive(Clone, Debug)]
pub struct PackIndex {
    /// The leaves in priority order, and each leaf's position there, in
    /// `u32` (one entry per node of a cluster).
    order: Vec<u32>,
    pos: Vec<u32>,
    size: usize,
    tree: Vec<u32>,
    /// Leaves whose room changed since the last [`PackIndex::flush`],
    /// once each (`stale`), while fewer than a quarter of the leaves.
    pending: Vec<LeafId>,
    stale: Vec<bool>,
    /// A quarter of the leaves or more changed: the next flush rebuilds
    /// the whole tree (`pending` is empty and `stale` all false).
    all_stale: bool,
}

impl PackIndex {
    /// Index over `topo` with every leaf's room 0.
    pub fn new(topo: &Topology) -> Self {
        let mut order = Vec::with_capacity(topo.nr_leaves());
        for core in topo.cores() {
            order.extend(core.iter().map(|&l| l as u32));
        }
        let mut pos = vec![0; order.len()];
        for (i, &l) in order.iter().enumerate() {
            pos[l as usize] = i as u32;
        }
        let size = order.len().next_power_of_two();
        let n = order.len();
        Self {
            order,
            pos,
            size,
            tree: vec![0; 2 * size],
            pending: Vec::new(),
            stale: vec![false; n],
            all_stale: false,
        }
    }

    /// A leaf's room changed: [`PackIndex::flush`] reads it again.
    #[inline]
    pub fn mark(&mut self, leaf: LeafId) {
        if !self.all_stale && !self.stale[leaf] {
            if (self.pending.len() + 1) * 4 >= self.order.len() {
                for l in std::mem::take(&mut self.pending) {
                    self.stale[l] = false;
                }
                self.all_stale = true;
                return;
            }
            self.stale[leaf] = true;
            self.pending.push(leaf);
        }
    }

    /// Whether no room change awaits [`PackIndex::flush`].
    pub fn is_flushed(&self) -> bool {
        self.pending.is_empty() && !self.all_stale
    }

    /// Bring the tree up to date: every leaf marked since the last flush
    /// gets its room now (`room`). Many changes (a quarter of the leaves or
    /// more) rebuild the tree bottom-up in O(n) instead of climbing per
    /// leaf.
    pub fn flush(&mut self, room: impl Fn(LeafId) -> u32) {
        if self.all_stale {
            self.all_stale = false;
            for (i, &leaf) in self.order.iter().enumerate() {
                self.tree[self.size + i] = room(leaf as usize);
            }
            for i in (1..self.size).rev() {
                self.tree[i] = self.tree[2 * i].max(self.tree[2 * i + 1]);
            }
            return;
        }
        while let Some(leaf) = self.pending.pop() {
            self.stale[leaf] = false;
            self.update(leaf, room(leaf));
        }
    }

    /// The packing priority rank of a leaf's core: lower packs first.
    pub fn core_rank(topo: &Topology, leaf: LeafId) -> usize {
        topo.core_of(leaf)
    }

    /// Set a leaf's room.
    pub fn update(&mut self, leaf: LeafId, room: u32) {
        let mut i = self.size + self.pos[leaf] as usize;
        self.tree[i] = room;
        while i > 1 {
            i /= 2;
            self.tree[i] = self.tree[2 * i].max(self.tree[2 * i + 1]);
        }
    }

    /// The first leaf in priority order, at or after priority position
    /// `from`, whose room is at least `demand`.
    pub fn first_fit_from(&self, demand: u32, from: usize) -> Option<(usize, LeafId)> {
        debug_assert!(self.is_flushed(), "pack index read stale");
        if from >= self.order.len() {
            return None;
        }
        self.descend(1, 0, self.size, demand, from)
            .map(|p| (p, self.order[p] as usize))
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
        self.pos[leaf] as usize
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    proptest! {
        /// Room changes only marked, the index flushed before each query
        /// (after a few changes: one climb each; after many: the rebuild):
        /// the first fit is the scan's over the rooms in priority order.
        #[test]
        fn flushed_index_finds_the_scans_first_fit(
            spec in prop::sample::select(&["1s:4c:2t", "2s:3c:2t", "1s:17c:1t"][..]),
            ops in prop::collection::vec((0usize..40, 0u32..5, any::<bool>()), 1..120),
        ) {
            let t = Topology::from_spec(spec).unwrap();
            let n = t.nr_leaves();
            let mut p = PackIndex::new(&t);
            let mut room = vec![0u32; n];
            for (leaf, r, query) in ops {
                let leaf = leaf % n;
                room[leaf] = r;
                p.mark(leaf);
                if query {
                    p.flush(|l| room[l]);
                    prop_assert!(p.is_flushed());
                    for demand in 0..6 {
                        for from in 0..=n {
                            let want = (from..n).find(|&i| room[p.order[i] as usize] >= demand);
                            let got = p.first_fit_from(demand, from);
                            prop_assert_eq!(got, want.map(|i| (i, p.order[i] as usize)));
                        }
                    }
                }
            }
        }
    }

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
