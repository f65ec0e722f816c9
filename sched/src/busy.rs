//! Busy flags: a "fully busy" flag per domain (seed 003 and Ingo Molnar's
//! reply to it).
//!
//! * Set lazily: only from [`BusyFlags::tick`], bottom-up, and only while
//!   every child of the domain is busy. Setting is batched onto the tick so
//!   that a permanently busy system writes nothing on its hot paths.
//! * Cleared at once: when a leaf becomes idle, [`BusyFlags::mark_idle`]
//!   clears its domains upward and stops at the first one that was not
//!   busy, so the propagation rarely reaches the root.
//!
//! Invariant: a domain flagged busy has no idle leaf. It holds because a
//! flag is set only when all children are busy (and a child's flag implies
//! the same of its leaves), and every transition of a leaf to idle clears
//! the flags above it synchronously. Hence a search may skip a busy domain
//! without ever missing an idle leaf; a busy root means "queue, don't scan".

use crate::topology::{LeafId, NodeId, Topology};

/// One flag per tree node (leaves' entries are unused: a leaf's busyness is
/// read from its run queue), and per domain how many of its children are
/// busy (a leaf child by its run queue as last reported with
/// [`BusyFlags::set_leaf`], a domain child by its flag), so that the tick
/// decides "all children busy" in O(1) instead of visiting them.
#[derive(Clone, Debug)]
pub struct BusyFlags {
    busy: Vec<bool>,
    /// Per leaf: busy (not idle) as last reported.
    leaf_busy: Vec<bool>,
    /// Per tree node: children that are busy.
    nr_busy: Vec<u32>,
    /// Flags set by ticks.
    pub nr_set: u64,
    /// Flags cleared by idle transitions.
    pub nr_cleared: u64,
}

impl BusyFlags {
    /// All domains start not busy, and every leaf idle (the engine reports
    /// each leaf's real state with [`BusyFlags::set_leaf`]).
    pub fn new(topo: &Topology) -> Self {
        Self {
            busy: vec![false; topo.nodes().len()],
            leaf_busy: vec![false; topo.nr_leaves()],
            nr_busy: vec![0; topo.nodes().len()],
            nr_set: 0,
            nr_cleared: 0,
        }
    }

    /// True when the domain is flagged fully busy.
    pub fn is_busy(&self, node: NodeId) -> bool {
        self.busy[node]
    }

    /// A leaf's run queue changed: record whether it is busy (not idle).
    /// When it is idle, its domains' flags are cleared ([`Self::mark_idle`]).
    pub fn set_leaf(&mut self, topo: &Topology, leaf: LeafId, busy: bool) {
        if self.leaf_busy[leaf] != busy {
            self.leaf_busy[leaf] = busy;
            if let Some(p) = topo.node(leaf).parent {
                if busy {
                    self.nr_busy[p] += 1;
                } else {
                    self.nr_busy[p] -= 1;
                }
            }
        }
        if !busy {
            self.mark_idle(topo, leaf);
        }
    }

    /// A leaf became idle: clear its domains upward, stopping at the first
    /// domain that was not busy.
    pub fn mark_idle(&mut self, topo: &Topology, leaf: LeafId) {
        for d in topo.ancestors(leaf) {
            if !self.busy[d] {
                break;
            }
            self.busy[d] = false;
            self.nr_cleared += 1;
            if let Some(p) = topo.node(d).parent {
                self.nr_busy[p] -= 1;
            }
        }
    }

    /// The tick of `leaf`: if it is busy, flag its domains busy bottom-up
    /// while all their children are busy. `leaf_busy` is the leaves' state
    /// now, which must be what [`Self::set_leaf`] last recorded (checked in
    /// debug builds).
    pub fn tick(&mut self, topo: &Topology, leaf: LeafId, leaf_busy: impl Fn(LeafId) -> bool) {
        debug_assert_eq!(leaf_busy(leaf), self.leaf_busy[leaf], "leaf {leaf}");
        if !self.leaf_busy[leaf] {
            return;
        }
        for d in topo.ancestors(leaf) {
            if self.busy[d] {
                continue;
            }
            if self.nr_busy[d] as usize != topo.node(d).children.len() {
                return;
            }
            self.busy[d] = true;
            self.nr_set += 1;
            if let Some(p) = topo.node(d).parent {
                self.nr_busy[p] += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// The oracle: the flags as the seed sets them, visiting every child
    /// of each ancestor on every tick.
    struct Oracle {
        busy: Vec<bool>,
    }

    impl Oracle {
        fn tick(&mut self, topo: &Topology, leaf: LeafId, leaf_busy: &[bool]) {
            if !leaf_busy[leaf] {
                return;
            }
            for d in topo.ancestors(leaf) {
                if self.busy[d] {
                    continue;
                }
                let all = topo.node(d).children.iter().all(|&c| {
                    if topo.node(c).children.is_empty() {
                        leaf_busy[c]
                    } else {
                        self.busy[c]
                    }
                });
                if !all {
                    return;
                }
                self.busy[d] = true;
            }
        }

        fn mark_idle(&mut self, topo: &Topology, leaf: LeafId) {
            for d in topo.ancestors(leaf) {
                if !self.busy[d] {
                    break;
                }
                self.busy[d] = false;
            }
        }
    }

    proptest! {
        /// Counting busy children gives the same flags as visiting them,
        /// after any sequence of leaf changes and ticks.
        #[test]
        fn counted_flags_match_the_visiting_oracle(
            spec in prop::sample::select(&["1s:4c:2t", "2z:3r:4n", "2z:2r:3n:2h", "2s:2c:1t:llc=2"][..]),
            ops in prop::collection::vec((any::<bool>(), 0usize..64, any::<bool>()), 1..200),
        ) {
            let topo = Topology::from_spec(spec).unwrap();
            let n = topo.nr_leaves();
            let mut flags = BusyFlags::new(&topo);
            let mut oracle = Oracle { busy: vec![false; topo.nodes().len()] };
            let mut state = vec![false; n];
            for (tick, leaf, busy) in ops {
                let leaf = leaf % n;
                if tick {
                    flags.tick(&topo, leaf, |l| state[l]);
                    oracle.tick(&topo, leaf, &state);
                } else {
                    state[leaf] = busy;
                    flags.set_leaf(&topo, leaf, busy);
                    if !busy {
                        oracle.mark_idle(&topo, leaf);
                    }
                }
                for d in 0..topo.nodes().len() {
                    prop_assert_eq!(flags.is_busy(d), oracle.busy[d], "node {}", d);
                }
            }
        }
    }
}
