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
/// read from its run queue).
#[derive(Clone, Debug)]
pub struct BusyFlags {
    busy: Vec<bool>,
    /// Flags set by ticks.
    pub nr_set: u64,
    /// Flags cleared by idle transitions.
    pub nr_cleared: u64,
}

impl BusyFlags {
    /// All domains start not busy.
    pub fn new(topo: &Topology) -> Self {
        Self {
            busy: vec![false; topo.nodes().len()],
            nr_set: 0,
            nr_cleared: 0,
        }
    }

    /// True when the domain is flagged fully busy.
    pub fn is_busy(&self, node: NodeId) -> bool {
        self.busy[node]
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
        }
    }

    /// The tick of `leaf`: if it is busy, flag its domains busy bottom-up
    /// while all their children are busy.
    pub fn tick(&mut self, topo: &Topology, leaf: LeafId, leaf_busy: impl Fn(LeafId) -> bool) {
        if !leaf_busy(leaf) {
            return;
        }
        for d in topo.ancestors(leaf) {
            if self.busy[d] {
                continue;
            }
            let all = topo.node(d).children.iter().all(|&c| {
                if topo.node(c).children.is_empty() {
                    leaf_busy(c)
                } else {
                    self.busy[c]
                }
            });
            if !all {
                return;
            }
            self.busy[d] = true;
            self.nr_set += 1;
        }
    }
}
