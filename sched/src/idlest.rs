//! The index behind `find_idlest`'s descent: per domain, which child has
//! the largest share of free capacity among those with room.
//!
//! `find_idlest` (the kernel's `find_idlest_group` at each level) picks,
//! among a domain's children whose largest room at the task's alignment
//! holds its demand (and that are not flagged fully busy), the one with
//! the largest `sum_free / capacity` (32.32 fixed point), then the largest
//! `sum_free`, then the first in child order. Scanning the children costs
//! a rack's ~100 nodes per placement; [`IdlestIndex`] keeps, per domain, a
//! tournament tree over its children (the way [`crate::pack::PackIndex`]
//! keeps one over leaves for pack) whose every segment holds the child
//! with the best key and the largest room per alignment level. A query
//! descends best-first and prunes segments without room or whose best key
//! cannot beat the child already found: O(log fanout) when the best child
//! has room, never worse than the scan.
//!
//! Invariant: every slot equals the combination of the children's
//! aggregates as last given to [`IdlestIndex::update`], which the engine
//! calls wherever an aggregate changes (`refresh_aggregates`).

use crate::alloc::Align;
use crate::sched::NodeAgg;
use crate::topology::{NodeId, Topology};

/// No child in the segment (padding up to a power of two).
const NONE: u32 = u32::MAX;

/// One segment of a domain's children.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Slot {
    /// The [`share_key`] of the best child (0 for an empty segment).
    key: u128,
    /// Position (in the domain's children) of the child with the best key,
    /// the first one on ties; [`NONE`] for an empty segment.
    best: u32,
    /// Largest `max_room` per alignment level over the segment, then the
    /// largest `max_free`.
    room: [u32; 6],
}

const EMPTY: Slot = Slot {
    key: 0,
    best: NONE,
    room: [0; 6],
};

/// A child's maxima as a slot holds them.
fn maxima_of(a: &NodeAgg) -> [u32; 6] {
    let r = a.max_room;
    [r[0], r[1], r[2], r[3], r[4], a.max_free]
}

/// Per domain, a tournament tree over its children keyed by free share.
#[derive(Clone, Debug)]
pub struct IdlestIndex {
    /// Per tree node: its position among its parent's children.
    pos: Vec<u32>,
    /// Per tree node: where its tree starts in `slots` and its width (a
    /// power of two, 0 for a leaf).
    base: Vec<usize>,
    width: Vec<usize>,
    /// All domains' trees; slot `base + 1` is a domain's root, `base + width
    /// + i` its child `i`.
    slots: Vec<Slot>,
}

impl IdlestIndex {
    /// The index of `topo` with every aggregate 0 (as `Sched` starts).
    pub fn new(topo: &Topology) -> Self {
        let n = topo.nodes().len();
        let mut pos = vec![0; n];
        let mut base = vec![0; n];
        let mut width = vec![0; n];
        let mut slots = Vec::new();
        for (d, dom) in topo.nodes().iter().enumerate() {
            if dom.children.is_empty() {
                continue;
            }
            let w = dom.children.len().next_power_of_two();
            base[d] = slots.len();
            width[d] = w;
            slots.resize(slots.len() + 2 * w, EMPTY);
            for (i, &c) in dom.children.iter().enumerate() {
                pos[c] = i as u32;
                slots[base[d] + w + i].best = i as u32;
            }
        }
        let mut ix = Self {
            pos,
            base,
            width,
            slots,
        };
        for d in 0..n {
            for i in (1..ix.width[d]).rev() {
                ix.combine(d, i);
            }
        }
        ix
    }

    /// Child `c`'s aggregate changed to `a`: re-key it in its parent's tree.
    /// Stops climbing at the first segment that stays the same (each slot
    /// carries its best child's key, so nothing above can change).
    ///
    /// Each level joins the pair of slots under the parent in place (left
    /// `i & !1`, right `i | 1`: no branch on which side changed), and the
    /// pair is read as one two-slot chunk (one bounds check).
    pub fn update(&mut self, topo: &Topology, c: NodeId, a: &NodeAgg) {
        let Some(d) = topo.node(c).parent else {
            return;
        };
        let p = self.pos[c] as usize;
        let (b, w) = (self.base[d], self.width[d]);
        let tree = &mut self.slots[b..b + 2 * w];
        let mut i = w + p;
        let cur = Slot {
            key: share_key(a),
            best: p as u32,
            room: maxima_of(a),
        };
        if tree[i] == cur {
            return;
        }
        tree[i] = cur;
        while i > 1 {
            let parent = match &tree[i & !1..(i | 1) + 1] {
                [l, r] => join(l, r),
                _ => unreachable!("a pair of slots"),
            };
            i /= 2;
            if tree[i] == parent {
                break;
            }
            tree[i] = parent;
        }
    }

    /// Domain `d`'s maxima over its children, as last updated: `max_room`
    /// per alignment level and `max_free` (all 0 for a leaf).
    pub fn maxima(&self, d: NodeId) -> ([u32; 5], u32) {
        if self.width[d] == 0 {
            return ([0; 5], 0);
        }
        let r = self.slots[self.base[d] + 1].room;
        ([r[0], r[1], r[2], r[3], r[4]], r[5])
    }

    /// Recompute slot `i` of domain `d`'s tree from its two halves.
    fn combine(&mut self, d: NodeId, i: usize) -> Slot {
        let b = self.base[d];
        let s = join(&self.slots[b + 2 * i], &self.slots[b + 2 * i + 1]);
        self.slots[b + i] = s;
        s
    }

    /// `find_idlest`'s choice among domain `d`'s children: the best key
    /// among those whose `max_room[align] >= demand` and that `eligible`
    /// accepts, the first in child order on ties; `None` when no child
    /// qualifies. `visited` counts the children examined.
    pub fn idlest_child(
        &self,
        topo: &Topology,
        d: NodeId,
        align: Align,
        demand: u32,
        eligible: impl Fn(NodeId) -> bool,
        visited: &mut u64,
    ) -> Option<NodeId> {
        let w = self.width[d];
        if w == 0 {
            return None;
        }
        let children = &topo.node(d).children;
        let b = self.base[d];
        // The root's best child (best key, first on ties) qualifies: it is
        // the answer, and the search would examine it alone (best-first to
        // it, then every other segment pruned on its key).
        let root = &self.slots[b + 1];
        if root.best == NONE || root.room[align.index()] < demand {
            return None;
        }
        let top = root.best as usize;
        if self.slots[b + w + top].room[align.index()] >= demand && eligible(children[top]) {
            *visited += 1;
            return Some(children[top]);
        }
        self.search(topo, d, align, demand, eligible, visited)
    }

    /// [`IdlestIndex::idlest_child`] without its shortcut: the best-first
    /// search over the segments.
    pub(crate) fn search(
        &self,
        topo: &Topology,
        d: NodeId,
        align: Align,
        demand: u32,
        eligible: impl Fn(NodeId) -> bool,
        visited: &mut u64,
    ) -> Option<NodeId> {
        let w = self.width[d];
        if w == 0 {
            return None;
        }
        let children = &topo.node(d).children;
        let b = self.base[d];
        // The chosen child so far: (key, position).
        let mut found: Option<(u128, u32)> = None;
        // Best-first, depth-first over the segments (depth <= 32).
        let mut stack = [0usize; 64];
        let mut top = 1;
        stack[0] = 1;
        while top > 0 {
            top -= 1;
            let i = stack[top];
            let s = &self.slots[b + i];
            if s.best == NONE || s.room[align.index()] < demand {
                continue;
            }
            // Nothing in the segment beats the chosen child: a better key,
            // or the same key earlier in child order.
            if let Some((fk, fp)) = found
                && !(s.key > fk || (s.key == fk && s.best < fp))
            {
                continue;
            }
            if i >= w {
                *visited += 1;
                if eligible(children[s.best as usize]) {
                    found = Some((s.key, s.best));
                }
                continue;
            }
            // Push the worse half first so the better one is searched first.
            let (l, r) = (2 * i, 2 * i + 1);
            let (ls, rs) = (&self.slots[b + l], &self.slots[b + r]);
            let right_first = rs.best != NONE && (ls.best == NONE || rs.key > ls.key);
            let (first, second) = if right_first { (r, l) } else { (l, r) };
            stack[top] = second;
            stack[top + 1] = first;
            top += 2;
        }
        found.map(|(_, p)| children[p as usize])
    }
}

/// The segment made of halves `l` (the earlier children) and `r`.
#[inline]
fn join(l: &Slot, r: &Slot) -> Slot {
    let mut room = l.room;
    for (m, x) in room.iter_mut().zip(r.room) {
        *m = (*m).max(x);
    }
    // The left half holds the earlier children: it wins ties.
    let (key, best) = if r.best != NONE && (l.best == NONE || r.key > l.key) {
        (r.key, r.best)
    } else {
        (l.key, l.best)
    };
    Slot { key, best, room }
}

/// `find_idlest`'s order of children as one integer: the free share
/// `sum_free / capacity` in 32.32 fixed point above `sum_free`. The share
/// is at most `1 << 32` (a leaf's room never exceeds its capacity, and a
/// capacity of 0 has no room), so it fits above the 64 bits of `sum_free`
/// and comparing keys compares `(share, sum_free)` lexicographically.
fn share_key(a: &NodeAgg) -> u128 {
    debug_assert!(a.sum_free <= a.capacity, "room beyond capacity: {a:?}");
    (fixed_share(a.sum_free, a.capacity.max(1)) << 64) | a.sum_free as u128
}

/// `(num << 32) / den` in u128 (a 32.32 fixed-point ratio), computed in
/// u64 when `num` fits 32 bits (always, on real clusters): the 128-bit
/// division is a library call. `den` must not be 0.
pub(crate) fn fixed_share(num: u64, den: u64) -> u128 {
    if num <= u32::MAX as u64 {
        ((num << 32) / den) as u128
    } else {
        ((num as u128) << 32) / den as u128
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use proptest::prelude::*;

    use crate::alloc::{Align, FreeSummary};
    use crate::config::SchedConfig;
    use crate::sched::Sched;
    use crate::task::{TaskId, TaskSpec, TaskState};
    use crate::topology::Topology;

    /// Fanouts that are and are not powers of two, several levels deep.
    const TOPOLOGIES: &[&str] = &[
        "2z:2r:3n",
        "3z:1r:7n",
        "2z:3r:5n:2h",
        "1s:2c:2t",
        "1z:1r:17n",
    ];
    const TASKS: u64 = 24;

    /// Every domain's choice from the index equals the scan it replaced
    /// (`Sched::idlest_child_scan`), for every alignment and every demand
    /// from 0 to one past the largest capacity.
    fn check_all(s: &Sched, max_cap: u32) -> Result<(), TestCaseError> {
        let topo = s.topology().clone();
        let skip_busy = s.config().busy_skip;
        for d in 0..topo.nodes().len() {
            if topo.node(d).children.is_empty() {
                continue;
            }
            for align in Align::ALL {
                for demand in 0..=max_cap + 1 {
                    let mut visited = 0;
                    let got = s.idlest.idlest_child(
                        &topo,
                        d,
                        align,
                        demand,
                        |c| !(skip_busy && s.busy_flags().is_busy(c)),
                        &mut visited,
                    );
                    let want = s.idlest_child_scan(d, align, demand);
                    prop_assert_eq!(got, want, "domain {} {:?} demand {}", d, align, demand);
                    // The shortcut examines what the search examines.
                    let mut searched = 0;
                    let full = s.idlest.search(
                        &topo,
                        d,
                        align,
                        demand,
                        |c| !(skip_busy && s.busy_flags().is_busy(c)),
                        &mut searched,
                    );
                    prop_assert_eq!(full, want);
                    prop_assert_eq!(
                        visited,
                        searched,
                        "domain {} {:?} demand {}",
                        d,
                        align,
                        demand
                    );
                    prop_assert!(visited <= topo.node(d).children.len() as u64);
                }
            }
        }
        Ok(())
    }

    proptest! {
        /// Random wakes, blocks, ticks (busy flags) and free summaries
        /// (room per alignment) on random capacities, with and without
        /// backfill and busy skipping: the index always picks the child
        /// the scan picks.
        #[test]
        fn index_picks_what_the_scan_picks(
            topo in prop::sample::select(TOPOLOGIES),
            caps in prop::collection::vec(0u32..9, 40),
            backfill in any::<bool>(),
            busy_skip in any::<bool>(),
            demands in prop::collection::vec((1u32..6, 0usize..5), TASKS as usize),
            ops in prop::collection::vec((0..TASKS, 0u8..4, 0usize..40, 0u32..9), 1..50),
        ) {
            let t = Arc::new(Topology::from_spec(topo).unwrap());
            let n = t.nr_leaves();
            let config = SchedConfig { backfill, busy_skip, ..SchedConfig::default() };
            let mut s = Sched::with_capacities(t, &caps[..n], config);
            for (i, &(demand, align)) in demands.iter().enumerate() {
                let mut spec = TaskSpec::new(TaskId(i as u64));
                spec.demand = demand;
                spec.align = Align::ALL[align];
                s.add_task(spec).unwrap();
            }
            let max_cap = caps[..n].iter().copied().max().unwrap_or(0);
            check_all(&s, max_cap)?;
            for (step, &(task, op, leaf, room)) in ops.iter().enumerate() {
                let now = step as u64 * 1_000_000;
                let id = TaskId(task);
                match op {
                    0 | 1 => {
                        if s.task(id).unwrap().state == TaskState::Sleeping {
                            s.wake_up(id, None, false, now).unwrap();
                        } else {
                            s.block(id, now).unwrap();
                        }
                    }
                    2 => {
                        for l in 0..n {
                            s.tick(l, now);
                        }
                    }
                    _ => {
                        let summary = FreeSummary { core: room / 4, llc: room / 2, numa: room, package: room, any: room };
                        s.set_free_summary(leaf % n, Some(summary), now).unwrap();
                    }
                }
                check_all(&s, max_cap)?;
            }
        }
    }
}
