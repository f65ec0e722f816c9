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
//!
//! [`NohzMask`]: which leaves tick at all. An empty idle leaf's tick does
//! nothing, so it is stopped (NO_HZ idle) and a cluster tick visits only
//! leaves with work.

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
            if let Some(p) = topo.node(leaf).parent() {
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
            if let Some(p) = topo.node(d).parent() {
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
            if self.nr_busy[d] as usize != topo.node(d).nr_children() {
                return;
            }
            self.busy[d] = true;
            self.nr_set += 1;
            if let Some(p) = topo.node(d).parent() {
                self.nr_busy[p] += 1;
            }
        }
    }
}

/// The leaves whose tick runs (NO_HZ idle): every leaf except those that
/// are empty (nothing running or waiting) and idle (room for a newcomer).
/// For such a leaf [`crate::Sched::tick`] does nothing: no running task
/// to account, no slice to end, and a leaf that is not busy sets no busy
/// flag. The kernel stops the tick of an idle CPU the same way
/// (`tick_nohz_idle_stop_tick`); here the mask follows every queue change
/// (`Sched::rq_changed`), so no tick polls an idle leaf to learn that it
/// is idle, and a cluster tick costs O(leaves with work), not O(leaves).
///
/// A leaf of capacity 0 with nothing on it is not idle (no room): it keeps
/// ticking, because its tick counts it busy for its domains' flags.
#[derive(Clone, Debug)]
pub struct NohzMask {
    words: Vec<u64>,
    nr_ticking: usize,
}

impl NohzMask {
    /// No leaf ticks.
    pub fn new(nr_leaves: usize) -> Self {
        Self {
            words: vec![0; nr_leaves.div_ceil(64)],
            nr_ticking: 0,
        }
    }

    /// Record whether `leaf`'s tick runs.
    pub fn set(&mut self, leaf: LeafId, ticking: bool) {
        let (w, b) = (leaf / 64, 1u64 << (leaf % 64));
        let was = self.words[w] & b != 0;
        if was != ticking {
            self.words[w] ^= b;
            if ticking {
                self.nr_ticking += 1;
            } else {
                self.nr_ticking -= 1;
            }
        }
    }

    /// True when `leaf`'s tick runs.
    pub fn is_ticking(&self, leaf: LeafId) -> bool {
        self.words
            .get(leaf / 64)
            .is_some_and(|w| w & (1u64 << (leaf % 64)) != 0)
    }

    /// How many leaves tick.
    pub fn nr_ticking(&self) -> usize {
        self.nr_ticking
    }

    /// The first ticking leaf `>= from`, read from the mask as it is now
    /// (a caller that changes the mask between calls sees the change).
    pub fn next_ticking(&self, from: LeafId) -> Option<LeafId> {
        let mut w = from / 64;
        let mut word = self.words.get(w)? & (!0u64 << (from % 64));
        loop {
            if word != 0 {
                return Some(w * 64 + word.trailing_zeros() as usize);
            }
            w += 1;
            word = *self.words.get(w)?;
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
                let all = topo.children(d).iter().all(|&c| {
                    if topo.node(c).is_leaf() {
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
        /// `next_ticking` walks exactly the set leaves, in order, and the
        /// count follows; checked against a plain `Vec<bool>`.
        #[test]
        fn nohz_mask_walks_the_set_leaves(
            n in 1usize..300,
            ops in prop::collection::vec((0usize..300, any::<bool>()), 0..200),
        ) {
            let mut mask = NohzMask::new(n);
            let mut oracle = vec![false; n];
            for (leaf, on) in ops {
                let leaf = leaf % n;
                mask.set(leaf, on);
                oracle[leaf] = on;
            }
            let mut walked = Vec::new();
            let mut next = mask.next_ticking(0);
            while let Some(l) = next {
                walked.push(l);
                next = mask.next_ticking(l + 1);
            }
            let want: Vec<usize> = (0..n).filter(|&l| oracle[l]).collect();
            prop_assert_eq!(&walked, &want);
            prop_assert_eq!(mask.nr_ticking(), want.len());
            for (l, &on) in oracle.iter().enumerate() {
                prop_assert_eq!(mask.is_ticking(l), on);
            }
        }

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
