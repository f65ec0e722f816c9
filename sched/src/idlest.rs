//! The index behind `find_idlest`'s descent: per domain, which child has
//! the largest share of free capacity among those with room.
//!
//! `find_idlest` (the kernel's `find_idlest_group` at each level) picks,
//! among a domain's children whose largest room at the task's alignment
//! holds its demand (and that are not flagged fully busy), the one with
//! the largest `sum_free / capacity` (32.32 fixed point), then the largest
//! `sum_free`, then the first in child order. Scanning the children costs
//! a rack's ~100 nodes per placement; [`IdlestIndex`] keeps, per domain,
//! two tournament trees over its children (the way
//! [`crate::pack::PackIndex`] keeps one over leaves for pack): in the key
//! tree every segment holds the best child's key, a single integer that
//! orders children as `find_idlest` does, its position included
//! ([`order_key`]); in the room tree every segment holds the largest room
//! per alignment level. A query descends best-first and prunes segments
//! without room or whose best key cannot beat the child already found:
//! O(log fanout) when the best child has room, never worse than the scan.
//!
//! The two trees climb separately, each stopping at the first segment
//! that stays the same: a placement changes its node's key up to the
//! domain's root, but its maxima only where the node held one.
//!
//! Only every other level of the binary trees is stored: the children's
//! level, the levels two, four, ... above it, and the root, one level
//! after another from the root ([`slot`]; the levels between take no
//! room). A stored segment is the join of its four grandchildren
//! (contiguous slots), so a climb takes half the steps; a level between
//! is read, by the search alone, as the join of its two stored children
//! (the search walks the same binary tree, and examines the same
//! children, as when every level was stored). The children's level, the
//! last of a domain's slots, stops at the last group of four slots with
//! a child ([`kept_len`]: a rack of 40 nodes keeps 40 of its 64).
//!
//! The keys are held in 64 bits while every one fits ([`narrow_key`]:
//! `sum_free` below `2^(31 - pos_bits)`, millions of CPUs per domain),
//! and in 128 bits from the first that does not ([`Keys`]). The room
//! trees are held in 16-bit lanes while every value fits (a node's
//! CPUs), one vector joined by one signed maximum per segment, and in
//! 32-bit lanes from the first value that does not ([`Rooms`]).
//!
//! Invariant: every slot of both trees equals the combination of the
//! children's aggregates as last given to [`IdlestIndex::update`], which
//! the engine calls wherever an aggregate changes (`refresh_aggregates`).

use crate::alloc::Align;
use crate::sched::NodeAgg;
use crate::topology::{NodeId, Topology};

/// A slot of either tree: joined with its sibling segments by one
/// associative and commutative operation (a key's maximum, the lanes'
/// maxima), and compared to stop a climb.
trait Join: Copy + PartialEq + std::fmt::Debug {
    /// The slot of a segment made of halves `self` and `r`.
    fn join(&self, r: &Self) -> Self;
    /// `self == r`, in the form that compiles to the fewest compares.
    fn same(&self, r: &Self) -> bool;
}

/// A segment's maxima: the largest `max_room` per alignment level over
/// its children, then the largest `max_free` (all 0 for padding), each
/// held as a lane of the value with its sign bit flipped: the signed
/// order of lanes is the unsigned order of values, so a join is a signed
/// maximum, which SSE2 has (an unsigned one costs two sign flips more
/// per lane group). Two widths ([`Rooms`]): 16-bit lanes, the six in one
/// 16-byte vector joined by one `pmaxsw`, while every value fits 16 bits
/// (a leaf's room is at most its capacity: a node's CPUs); 32-bit lanes
/// otherwise, a join of two vectors of four by compare and blend.
trait Lanes: Join {
    /// The maxima of a padding slot (and of a child with no room).
    const NONE: Self;
    /// A child's maxima as a slot holds them (the values must fit).
    fn of(a: &NodeAgg) -> Self;
    /// Lane `i`'s value (`Align::index`, 5 for `max_free`).
    fn get(&self, i: usize) -> u32;
}

/// 32-bit lanes: any `u32`.
type Maxima = [i32; 6];

/// A `u32` as a lane of [`Maxima`]: the sign bit flipped, so the signed
/// order of lanes is the unsigned order of values.
#[inline]
fn lane(x: u32) -> i32 {
    (x ^ (1 << 31)) as i32
}

/// The `u32` a lane of [`Maxima`] holds.
#[inline]
fn value(l: i32) -> u32 {
    (l as u32) ^ (1 << 31)
}

impl Join for Maxima {
    #[inline]
    fn join(&self, r: &Self) -> Self {
        let mut m = *self;
        for (m, x) in m.iter_mut().zip(r) {
            *m = (*m).max(*x);
        }
        m
    }

    #[inline]
    fn same(&self, r: &Self) -> bool {
        self == r
    }
}

impl Lanes for Maxima {
    const NONE: Self = [i32::MIN; 6];

    #[inline]
    fn of(a: &NodeAgg) -> Self {
        let r = a.max_room;
        [r[0], r[1], r[2], r[3], r[4], a.max_free].map(lane)
    }

    #[inline]
    fn get(&self, i: usize) -> u32 {
        value(self[i])
    }
}

/// 16-bit lanes, the six of [`Maxima`] and two of padding (`i16::MIN`,
/// never read), for values below 2^16.
type Narrow = [i16; 8];

impl Join for Narrow {
    #[inline]
    fn join(&self, r: &Self) -> Self {
        let mut m = *self;
        for (m, x) in m.iter_mut().zip(r) {
            *m = (*m).max(*x);
        }
        m
    }

    /// Lane by lane without a branch (`pcmpeqw`, `pmovmskb`): the array's
    /// `==` compiles to a byte compare of two 64-bit halves, each first
    /// moved out of the vector register lane by lane.
    #[inline]
    fn same(&self, r: &Self) -> bool {
        self.iter().zip(r).fold(true, |all, (a, b)| all & (a == b))
    }
}

impl Lanes for Narrow {
    const NONE: Self = [i16::MIN; 8];

    #[inline]
    fn of(a: &NodeAgg) -> Self {
        debug_assert!(fits_narrow(a), "maxima beyond 16 bits: {a:?}");
        let r = a.max_room;
        let l = |x: u32| (x as u16 ^ (1 << 15)) as i16;
        [
            l(r[0]),
            l(r[1]),
            l(r[2]),
            l(r[3]),
            l(r[4]),
            l(a.max_free),
            i16::MIN,
            i16::MIN,
        ]
    }

    #[inline]
    fn get(&self, i: usize) -> u32 {
        ((self[i] as u16) ^ (1 << 15)) as u32
    }
}

/// Whether an aggregate's maxima fit [`Narrow`] lanes.
#[inline]
fn fits_narrow(a: &NodeAgg) -> bool {
    let r = a.max_room;
    (r[0] | r[1] | r[2] | r[3] | r[4] | a.max_free) >> 16 == 0
}

/// The maxima as `max_room` per alignment level and `max_free`.
#[inline]
fn values<L: Lanes>(m: &L) -> ([u32; 5], u32) {
    ([m.get(0), m.get(1), m.get(2), m.get(3), m.get(4)], m.get(5))
}

/// A key of the key trees: [`order_key`]'s order of children, in 128
/// bits (any values) or in 64 ([`narrow_key`], while they fit); 0 is
/// the padding's, below every child's.
trait Key: Join + Ord {
    /// The padding's key.
    const PAD: Self;
    /// The child position the key names, positions taking `pos_bits`
    /// bits in a 64-bit key ([`IdlestIndex::pos_bits`]).
    fn position(self, pos_bits: u32) -> usize;
    /// The same key in 128 bits ([`order_key`]).
    fn wide(self, pos_bits: u32) -> u128;
}

impl Join for u128 {
    #[inline]
    fn join(&self, r: &Self) -> Self {
        (*self).max(*r)
    }

    #[inline]
    fn same(&self, r: &Self) -> bool {
        self == r
    }
}

impl Key for u128 {
    const PAD: Self = 0;

    #[inline]
    fn position(self, _: u32) -> usize {
        position_of(self)
    }

    #[inline]
    fn wide(self, _: u32) -> u128 {
        self
    }
}

impl Join for u64 {
    #[inline]
    fn join(&self, r: &Self) -> Self {
        (*self).max(*r)
    }

    #[inline]
    fn same(&self, r: &Self) -> bool {
        self == r
    }
}

impl Key for u64 {
    const PAD: Self = 0;

    #[inline]
    fn position(self, pos_bits: u32) -> usize {
        (!self & ((1 << pos_bits) - 1)) as usize
    }

    fn wide(self, pos_bits: u32) -> u128 {
        if self == 0 {
            return 0;
        }
        let share = self >> 31;
        let sum_free = (self >> pos_bits) & ((1 << (31 - pos_bits)) - 1);
        let p = self.position(pos_bits) as u32;
        ((share as u128) << 95) | ((sum_free as u128) << 32) | (!p) as u128
    }
}

/// All domains' key trees: in 64 bits while every key fits
/// ([`narrow_key`]), then in 128 bits for good ([`IdlestIndex::widen_keys`]).
#[derive(Clone, Debug)]
enum Keys {
    Narrow(Vec<u64>),
    Wide(Vec<u128>),
}

/// All domains' room trees, laid out as the key trees: in 16-bit lanes
/// until a value needs more, then in 32-bit lanes for good
/// ([`IdlestIndex::widen`]).
#[derive(Clone, Debug)]
enum Rooms {
    Narrow(Vec<Narrow>),
    Wide(Vec<Maxima>),
}

/// Where a tree node's slots are in its parent's trees: all that
/// [`IdlestIndex::update`] looks up, in one place.
#[derive(Clone, Copy, Debug, Default)]
struct Up {
    /// The parent's `base`.
    tree: u32,
    /// The parent's `width` (0: no parent).
    width: u32,
    /// The node's position among the parent's children.
    pos: u32,
}

/// Per domain, tournament trees over its children keyed by free share.
#[derive(Clone, Debug)]
pub struct IdlestIndex {
    /// Per tree node: where it sits in its parent's trees ([`Up`]).
    up: Vec<Up>,
    /// Per tree node: where its trees start in `keys` and `rooms` and
    /// their width in children slots (a power of two, 0 for a leaf), in
    /// `u32` as `Up`'s (one entry per tree node: a cluster's every node
    /// has one).
    base: Vec<u32>,
    width: Vec<u32>,
    /// The bits of a child position in a 64-bit key: the fewest that hold
    /// every domain's positions with a nonzero key ([`narrow_key`]).
    pos_bits: u32,
    /// `2^(31 - pos_bits)`: the first `sum_free` a 64-bit key does not
    /// hold ([`narrow_key`]).
    free_limit: u64,
    /// All domains' key trees, each domain's [`stored`] segments only, in
    /// [`slot`] order from `base` (its root at `base + 1`). A segment holds
    /// the largest key of its children ([`order_key`]; 0, below every
    /// child's, for padding up to a power of two).
    keys: Keys,
    /// All domains' room trees, laid out as `keys` ([`Rooms`]).
    rooms: Rooms,
}

/// The trees of every domain with every aggregate 0, in one width: each
/// domain's children (`nr_children`) keyed by `key_of(position)`, its
/// padding slots 0, each domain's [`kept_len`] slots.
fn initial_trees<K: Key, L: Lanes>(
    base: &[u32],
    width: &[u32],
    nr_children: &[u32],
    len: usize,
    key_of: impl Fn(u32) -> K,
) -> (Vec<K>, Vec<L>) {
    let mut keys = vec![K::PAD; len];
    let mut rooms = vec![L::NONE; len];
    for d in 0..base.len() {
        let (b, w) = (base[d] as usize, width[d] as usize);
        if w == 0 {
            continue;
        }
        // The whole trees, then their kept slots (the segments over
        // padding alone join trailing slots that are not kept).
        let mut k = vec![K::PAD; tree_len(w)];
        let mut r = vec![L::NONE; tree_len(w)];
        for i in 0..nr_children[d] {
            k[slot(w + i as usize)] = key_of(i);
        }
        for i in (1..w).rev() {
            if stored(i, w) {
                let (jk, jr) = join_below(&k, &r, i, w);
                k[slot(i)] = jk;
                r[slot(i)] = jr;
            }
        }
        let kept = kept_len(w, nr_children[d] as usize);
        keys[b..b + kept].copy_from_slice(&k[..kept]);
        rooms[b..b + kept].copy_from_slice(&r[..kept]);
    }
    (keys, rooms)
}

/// The most bits of a position for which 64-bit keys are kept: the rest
/// of [`narrow_key`]'s 31 low bits hold `sum_free`.
const MAX_POS_BITS: u32 = 30;

/// `$body` with `$t` bound to the trees ([`Tree`]) of the domain at
/// `$b` of width `$w`, in whichever widths the index holds them.
macro_rules! with_tree {
    ($ix:expr, $b:expr, $w:expr, |$t:ident| $body:expr) => {{
        let (base, width, pos_bits) = ($b, $w, $ix.pos_bits);
        match (&$ix.keys, &$ix.rooms) {
            (Keys::Narrow(k), Rooms::Narrow(rm)) => {
                let $t = Tree {
                    keys: k,
                    rooms: rm,
                    base,
                    width,
                    pos_bits,
                };
                $body
            }
            (Keys::Narrow(k), Rooms::Wide(rm)) => {
                let $t = Tree {
                    keys: k,
                    rooms: rm,
                    base,
                    width,
                    pos_bits,
                };
                $body
            }
            (Keys::Wide(k), Rooms::Narrow(rm)) => {
                let $t = Tree {
                    keys: k,
                    rooms: rm,
                    base,
                    width,
                    pos_bits,
                };
                $body
            }
            (Keys::Wide(k), Rooms::Wide(rm)) => {
                let $t = Tree {
                    keys: k,
                    rooms: rm,
                    base,
                    width,
                    pos_bits,
                };
                $body
            }
        }
    }};
}

impl IdlestIndex {
    /// The index of `topo` with every aggregate 0 (as `Sched` starts).
    pub fn new(topo: &Topology) -> Self {
        let n = topo.nodes().len();
        let mut up = vec![Up::default(); n];
        let mut base = vec![0u32; n];
        let mut width = vec![0u32; n];
        let mut nr_children = vec![0u32; n];
        let mut len = 0usize;
        for (d, dom) in topo.nodes().iter().enumerate() {
            if dom.is_leaf() {
                continue;
            }
            // At least two slots of children, so that a domain's trees
            // are whole groups of four slots below the root (`update`);
            // a lone child's padding sibling is never examined (its key
            // is 0).
            let w = dom.nr_children().next_power_of_two().max(2);
            base[d] = len as u32;
            width[d] = w as u32;
            nr_children[d] = dom.nr_children() as u32;
            len += kept_len(w, dom.nr_children());
            // Every domain's slots start at a multiple of four (`Climb`).
            debug_assert!(len.is_multiple_of(4));
            // Slots and positions in u32, as positions always were: a
            // topology of 2^30 nodes would need tens of GB first.
            debug_assert!(len < u32::MAX as usize, "index beyond u32 slots");
            for (i, &c) in topo.children(d).iter().enumerate() {
                up[c] = Up {
                    tree: base[d],
                    width: w as u32,
                    pos: i as u32,
                };
            }
        }
        // 2^pos_bits > the largest fanout: every position's `!p` in
        // `pos_bits` bits is nonzero.
        let fanout = nr_children.iter().copied().max().unwrap_or(0);
        let pos_bits = fanout.max(1).ilog2() + 1;
        let zero = NodeAgg::default();
        let free_limit = 1 << (31 - pos_bits.min(MAX_POS_BITS));
        let (keys, rooms) = match pos_bits <= MAX_POS_BITS {
            true => {
                let (k, r) = initial_trees(&base, &width, &nr_children, len, |p| {
                    // An aggregate of 0 fits any width.
                    narrow_key(&zero, p, pos_bits, free_limit).unwrap_or(u64::PAD)
                });
                (Keys::Narrow(k), r)
            }
            false => {
                let (k, r) =
                    initial_trees(&base, &width, &nr_children, len, |p| order_key(&zero, p));
                (Keys::Wide(k), r)
            }
        };
        Self {
            up,
            base,
            width,
            pos_bits,
            free_limit,
            keys,
            rooms: Rooms::Narrow(rooms),
        }
    }

    /// Hold the key trees in 128 bits from now on (the same order).
    fn widen_keys(&mut self) {
        if let Keys::Narrow(k) = &self.keys {
            let wide = k.iter().map(|&k| k.wide(self.pos_bits)).collect();
            self.keys = Keys::Wide(wide);
        }
    }

    /// Hold the room trees in 32-bit lanes from now on (the same values).
    fn widen(&mut self) {
        if let Rooms::Narrow(r) = &self.rooms {
            let wide = r
                .iter()
                .map(|m| {
                    let (room, free) = values(m);
                    [room[0], room[1], room[2], room[3], room[4], free].map(lane)
                })
                .collect();
            self.rooms = Rooms::Wide(wide);
        }
    }

    /// Child `c`'s aggregate changed to `a`: re-key it in its parent's
    /// trees. Each tree climbs from the child's slot, two levels a step
    /// (a stored segment joins its four grandchildren; the root, when
    /// one level above a stored one, its two children), and stops at the
    /// first segment that stays the same (nothing above it can change).
    /// The key trees widen to 128 bits at the first key that does not
    /// fit 64 ([`narrow_key`]), the room trees to 32-bit lanes at the
    /// first room beyond 16 bits. Returns the parent's maxima after the
    /// change ([`IdlestIndex::maxima`]), `None` for the root.
    ///
    /// Inlined into its one caller's climb (`refresh_aggregates`, one
    /// call per level of the tree): the call's own cost (saved registers,
    /// the answer through memory) was a fifth of a call.
    #[inline(always)]
    pub fn update(&mut self, c: NodeId, a: &NodeAgg) -> Option<([u32; 5], u32)> {
        let Up { tree, width, pos } = self.up[c];
        if width == 0 {
            return None;
        }
        let leaf = Climb::new(tree as usize, width as usize, pos as usize);
        // Every real cluster's case, the only code inlined: both trees in
        // their narrow widths and the new values fitting them.
        if let (Keys::Narrow(keys), Rooms::Narrow(rooms)) = (&mut self.keys, &mut self.rooms)
            && fits_narrow(a)
            && let Some(key) = narrow_key(a, pos, self.pos_bits, self.free_limit)
        {
            climb(keys, leaf, key);
            return Some(values(&climb(rooms, leaf, Narrow::of(a))));
        }
        Some(self.update_wide(leaf, pos, a))
    }

    /// [`IdlestIndex::update`] when a tree is (or becomes) wide: out of
    /// line, so that the update's inlined code is the narrow case's alone.
    #[cold]
    #[inline(never)]
    fn update_wide(&mut self, leaf: Climb, pos: u32, a: &NodeAgg) -> ([u32; 5], u32) {
        if let Keys::Narrow(keys) = &mut self.keys {
            match narrow_key(a, pos, self.pos_bits, self.free_limit) {
                Some(key) => {
                    climb(keys, leaf, key);
                }
                None => self.widen_keys(),
            }
        }
        if let Keys::Wide(keys) = &mut self.keys {
            climb(keys, leaf, order_key(a, pos));
        }

        if !fits_narrow(a) {
            self.widen();
        }
        match &mut self.rooms {
            Rooms::Narrow(rooms) => values(&climb(rooms, leaf, Narrow::of(a))),
            Rooms::Wide(rooms) => values(&climb(rooms, leaf, Maxima::of(a))),
        }
    }

    /// Domain `d`'s maxima over its children, as last updated: `max_room`
    /// per alignment level and `max_free` (all 0 for a leaf).
    pub fn maxima(&self, d: NodeId) -> ([u32; 5], u32) {
        if self.width[d] == 0 {
            return ([0; 5], 0);
        }
        match &self.rooms {
            Rooms::Narrow(r) => values(&r[self.base[d] as usize + 1]),
            Rooms::Wide(r) => values(&r[self.base[d] as usize + 1]),
        }
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
        let w = self.width[d] as usize;
        if w == 0 {
            return None;
        }
        let children = topo.children(d);
        let b = self.base[d] as usize;
        // Every real cluster's trees: the only search inlined.
        if let (Keys::Narrow(keys), Rooms::Narrow(rooms)) = (&self.keys, &self.rooms) {
            let tree = Tree {
                keys,
                rooms,
                base: b,
                width: w,
                pos_bits: self.pos_bits,
            };
            return idlest_in(&tree, children, align, demand, eligible, visited);
        }
        self.idlest_child_wide(b, w, children, align, demand, eligible, visited)
    }

    /// [`IdlestIndex::idlest_child`] when a tree is wide: out of line, as
    /// [`IdlestIndex::update_wide`].
    #[cold]
    #[inline(never)]
    #[allow(clippy::too_many_arguments)]
    fn idlest_child_wide(
        &self,
        b: usize,
        w: usize,
        children: &[NodeId],
        align: Align,
        demand: u32,
        eligible: impl Fn(NodeId) -> bool,
        visited: &mut u64,
    ) -> Option<NodeId> {
        with_tree!(self, b, w, |tree| idlest_in(
            &tree, children, align, demand, eligible, visited
        ))
    }

    /// [`IdlestIndex::idlest_child`] without its shortcut: the best-first
    /// search over the segments (tests).
    #[cfg(test)]
    fn search(
        &self,
        topo: &Topology,
        d: NodeId,
        align: Align,
        demand: u32,
        eligible: impl Fn(NodeId) -> bool,
        visited: &mut u64,
    ) -> Option<NodeId> {
        let w = self.width[d] as usize;
        if w == 0 {
            return None;
        }
        let children = topo.children(d);
        let b = self.base[d] as usize;
        with_tree!(self, b, w, |tree| search_tree(
            &tree, children, align, demand, eligible, visited
        ))
    }

    /// Both trees of domain `d` in the binary layout with every level
    /// computed from the children's slots, the binary join at each
    /// segment (as when every level was stored), in 128-bit keys and
    /// 32-bit lanes, for tests: slot `i` of `(keys, rooms)` is binary
    /// segment `i` (`1 <= i < 2 * width`).
    #[cfg(test)]
    fn full_trees(&self, d: NodeId) -> (Vec<u128>, Vec<Maxima>) {
        let (b, w) = (self.base[d] as usize, self.width[d] as usize);
        let (mut keys, mut rooms) = (vec![0u128; 2 * w], vec![Maxima::NONE; 2 * w]);
        let (all_keys, all_rooms) = (self.wide_keys(), self.wide_rooms());
        // Children slots not kept are padding.
        for i in (w..2 * w).filter(|&i| slot(i) < self.kept(d)) {
            keys[i] = all_keys[b + slot(i)];
            rooms[i] = all_rooms[b + slot(i)];
        }
        for i in (1..w).rev() {
            keys[i] = keys[2 * i].max(keys[2 * i + 1]);
            rooms[i] = rooms[2 * i].join(&rooms[2 * i + 1]);
        }
        (keys, rooms)
    }

    /// The slots domain `d` keeps ([`kept_len`]), from the layout: up to
    /// the next domain's trees (tests).
    #[cfg(test)]
    fn kept(&self, d: NodeId) -> usize {
        let len = match &self.keys {
            Keys::Narrow(k) => k.len(),
            Keys::Wide(k) => k.len(),
        };
        let next = (d + 1..self.width.len())
            .find(|&e| self.width[e] > 0)
            .map_or(len, |e| self.base[e] as usize);
        next - self.base[d] as usize
    }

    /// The key trees in 128 bits, whichever width holds them (tests).
    #[cfg(test)]
    fn wide_keys(&self) -> Vec<u128> {
        let mut ix = self.clone();
        ix.widen_keys();
        match ix.keys {
            Keys::Wide(k) => k,
            Keys::Narrow(_) => unreachable!("widened"),
        }
    }

    /// The room trees in 32-bit lanes, whichever width holds them (tests).
    #[cfg(test)]
    fn wide_rooms(&self) -> Vec<Maxima> {
        let mut ix = self.clone();
        ix.widen();
        match ix.rooms {
            Rooms::Wide(r) => r,
            Rooms::Narrow(_) => unreachable!("widened"),
        }
    }
}

/// [`IdlestIndex::idlest_child`] over one domain's trees. Always
/// inlined: out of line (LLVM's choice once the wide widths had their own
/// caller) its calls from `find_idlest` cost ~76 instructions per
/// placement.
#[inline(always)]
fn idlest_in<K: Key, L: Lanes>(
    tree: &Tree<'_, K, L>,
    children: &[NodeId],
    align: Align,
    demand: u32,
    eligible: impl Fn(NodeId) -> bool,
    visited: &mut u64,
) -> Option<NodeId> {
    // The root's best child (best key, first on ties) qualifies: it is
    // the answer, and the search would examine it alone (best-first to
    // it, then every other segment pruned on its key).
    let (root, room) = (
        tree.keys[tree.base + 1],
        tree.rooms[tree.base + 1].get(align.index()),
    );
    if root == K::PAD || room < demand {
        return None;
    }
    let top = root.position(tree.pos_bits);
    if tree.rooms[tree.base + slot(tree.width + top)].get(align.index()) >= demand
        && eligible(children[top])
    {
        *visited += 1;
        return Some(children[top]);
    }
    search_tree(tree, children, align, demand, eligible, visited)
}

/// [`IdlestIndex::search`] over one domain's trees.
fn search_tree<K: Key, L: Lanes>(
    tree: &Tree<'_, K, L>,
    children: &[NodeId],
    align: Align,
    demand: u32,
    eligible: impl Fn(NodeId) -> bool,
    visited: &mut u64,
) -> Option<NodeId> {
    let w = tree.width;
    // The chosen child so far, by its key (which names its position).
    let mut found: Option<K> = None;
    // Best-first, depth-first over the segments (depth <= 32).
    let mut stack = [0usize; 64];
    let mut top = 1;
    stack[0] = 1;
    while top > 0 {
        top -= 1;
        let i = stack[top];
        let (key, room) = tree.segment(i, align);
        if key == K::PAD || room < demand {
            continue;
        }
        // Nothing in the segment beats the chosen child: a better key,
        // or the same free share and sum earlier in child order (both
        // in the key).
        if found.is_some_and(|f| key <= f) {
            continue;
        }
        if i >= w {
            *visited += 1;
            if eligible(children[key.position(tree.pos_bits)]) {
                found = Some(key);
            }
            continue;
        }
        // Push the worse half first so the better one is searched first.
        let (l, r) = (2 * i, 2 * i + 1);
        let right_first = tree.key(r) > tree.key(l);
        let (first, second) = if right_first { (r, l) } else { (l, r) };
        stack[top] = second;
        stack[top + 1] = first;
        top += 2;
    }
    found.map(|k| children[k.position(tree.pos_bits)])
}

/// A child slot of one domain's trees as [`climb`] starts from it:
/// computed once per [`IdlestIndex::update`] for both trees.
#[derive(Clone, Copy, Debug)]
struct Climb {
    /// The domain's first group of four slots (`base / 4`).
    base: usize,
    /// The child's binary segment (`width + position`).
    leaf: usize,
    /// [`OFF`] of the children's level: `slot(i) = i - (off & !3)` there.
    /// It steps two levels up as `off' = (off + 2) / 4`: `4 * OFF[l - 2]`
    /// is `OFF[l] + 1` on even levels (where `OFF[l]` is 3 modulo 4) and
    /// `OFF[l] - 1` on odd ones (1 modulo 4), and `(off + 2) / 4` rounds
    /// to it on both (no parity test per update).
    off: usize,
}

impl Climb {
    /// Child `pos` of a domain of `w` children slots whose slots start at
    /// `base` (a multiple of four: every domain's slots are, [`tree_len`]).
    #[inline]
    fn new(base: usize, w: usize, pos: usize) -> Self {
        let level = w.trailing_zeros() as usize & 63;
        Self {
            base: base / 4,
            leaf: w + pos,
            off: OFF[level],
        }
    }
}

/// Put `x` in child slot `c.leaf` of one domain's tree (its slots,
/// [`slot`], from group `c.base` of all domains' `trees`) and climb as
/// [`IdlestIndex::update`] says; returns the domain's root.
///
/// The trees are read as groups of four slots: a stored level's slots
/// start at a multiple of four ([`slot`]), so slot `i` of level `l` is
/// place `i % 4` of group `i / 4 - OFF[l] / 4`, and the grandchildren of
/// a segment are one group; one bounds check per access. Always
/// inlined: out of line (as for [`idlest_in`]) its calls from
/// `refresh_aggregates` cost ~107 instructions per submit and finish.
#[inline(always)]
fn climb<T: Join>(trees: &mut [T], c: Climb, x: T) -> T {
    let Climb {
        base,
        leaf,
        mut off,
    } = c;
    let (tree, _) = trees.as_chunks_mut::<4>();
    let mut i = leaf;
    let s = &mut tree[base + i / 4 - off / 4][i % 4];
    if !s.same(&x) {
        *s = x;
        loop {
            if i < 4 {
                if i >= 2 {
                    // Slots 2 and 3 are stored: the root is their join.
                    let [_, _, l, r] = tree[base];
                    tree[base][1] = l.join(&r);
                }
                break;
            }
            let [g0, g1, g2, g3] = tree[base + i / 4 - off / 4];
            let parent = g0.join(&g1).join(&g2.join(&g3));
            i /= 4;
            off = (off + 2) / 4;
            let s = &mut tree[base + i / 4 - off / 4][i % 4];
            if s.same(&parent) {
                break;
            }
            *s = parent;
        }
    }
    tree[base][1]
}

/// Whether a domain's trees of `w` children slots keep slot `i` (`1 <= i
/// < 2 * w`): the root, the children's slots and every segment an even
/// number of levels above them.
#[inline]
fn stored(i: usize, w: usize) -> bool {
    i == 1 || (w.trailing_zeros() - i.ilog2()).is_multiple_of(2)
}

/// Where stored segment `i` ([`stored`]) of a domain's binary tree is
/// among the domain's slots: the root at 1, then the stored levels one
/// after another, each in order and from a multiple of four (so that
/// [`climb`] reads a segment's grandchildren as one group of four).
///
/// Packed from the root at 0, level `l` (segments `2^l .. 2^(l + 1)`)
/// would follow the levels `l - 2`, `l - 4`, ... and the root:
/// `(2^l - 1) / 3` slots for an even `l`, `(2^l + 1) / 3` for an odd
/// one, so `i` would be at `i - OFF[l]` (`OFF[l] = (2^(l + 1) + 1) / 3` rounded down
/// in both cases). `OFF[l]` is 3 modulo 4 on every even level from 2
/// and 1 on every odd one: three slots before the root of a tree of
/// even levels (`_, root, _, _`, then level 2) and one before the root
/// of a tree of odd levels (`_, root, l, r`, then level 3) make every
/// level from 2 start at a multiple of four, at `i - (OFF[l] & !3)`, the
/// root at 1 either way.
#[inline]
fn slot(i: usize) -> usize {
    i - (OFF[i.ilog2() as usize & 63] & !3)
}

/// `(2^(l + 1) + 1) / 3` for every level `l` ([`slot`]; a load where the
/// division by 3 took a multiplication and shifts).
const OFF: [usize; 64] = {
    let mut off = [0; 64];
    let mut l = 0;
    while l < 64 {
        off[l] = (((2u128 << l) + 1) / 3) as usize;
        l += 1;
    }
    off
};

/// The slots of a domain's trees of `w` children slots ([`slot`] of the
/// last child slot, plus one): a multiple of four.
#[inline]
fn tree_len(w: usize) -> usize {
    2 * w - (OFF[w.trailing_zeros() as usize & 63] & !3)
}

/// The slots a domain of `nr` children in `w` children slots keeps: its
/// [`tree_len`] without the children's slots past the last group of four
/// that holds a child. The children's level is the last of the layout, so
/// only the tail goes; a multiple of four still. Nothing reads those
/// slots: the search examines a segment of the children's level, or of
/// the level above it (two children slots), only below a stored segment
/// of four children slots with a child (its key is not padding's), and a
/// climb starts from a child's slot.
#[inline]
fn kept_len(w: usize, nr: usize) -> usize {
    tree_len(w) - (w - nr.next_multiple_of(4).min(w))
}

/// The join of a stored segment `i < w` from the stored slots below it:
/// its four grandchildren, or for the root one level above stored slots,
/// its two children.
fn join_below<K: Key, L: Lanes>(keys: &[K], rooms: &[L], i: usize, w: usize) -> (K, L) {
    let g = if i == 1 && w.trailing_zeros() % 2 == 1 {
        let g = slot(2);
        return (keys[g].join(&keys[g + 1]), rooms[g].join(&rooms[g + 1]));
    } else {
        slot(4 * i)
    };
    (
        keys[g]
            .join(&keys[g + 1])
            .join(&keys[g + 2].join(&keys[g + 3])),
        rooms[g]
            .join(&rooms[g + 1])
            .join(&rooms[g + 2].join(&rooms[g + 3])),
    )
}

/// One domain's trees as the search reads them: every binary segment,
/// a level that is not stored joined from its two (stored) children.
/// Read in all domains' trees from the domain's `base` (one bounds check
/// per access, none for a slice of the domain).
struct Tree<'a, K, L> {
    keys: &'a [K],
    rooms: &'a [L],
    base: usize,
    width: usize,
    pos_bits: u32,
}

impl<K: Key, L: Lanes> Tree<'_, K, L> {
    /// Segment `i`'s best key.
    #[inline]
    fn key(&self, i: usize) -> K {
        if stored(i, self.width) {
            self.keys[self.base + slot(i)]
        } else {
            let l = self.base + slot(2 * i);
            self.keys[l].join(&self.keys[l + 1])
        }
    }

    /// Segment `i`'s best key and its largest room at `align`.
    #[inline]
    fn segment(&self, i: usize, align: Align) -> (K, u32) {
        let a = align.index();
        if stored(i, self.width) {
            let s = self.base + slot(i);
            (self.keys[s], self.rooms[s].get(a))
        } else {
            let l = self.base + slot(2 * i);
            (
                self.keys[l].join(&self.keys[l + 1]),
                self.rooms[l].get(a).max(self.rooms[l + 1].get(a)),
            )
        }
    }
}

/// `order_key` in 64 bits, while `sum_free` fits `31 - pos_bits` bits
/// (`None` otherwise): the free share from bit 31 (at most `1 << 32`, 33
/// bits), then `sum_free` from bit `pos_bits`, then the position in
/// reverse (`!p` in `pos_bits` bits: nonzero, as `2^pos_bits` exceeds
/// every position). Keys of one index, both of this form, compare as
/// their [`order_key`]s do (`Key::wide` gives it back).
#[inline]
fn narrow_key(a: &NodeAgg, p: u32, pos_bits: u32, free_limit: u64) -> Option<u64> {
    debug_assert!(pos_bits <= MAX_POS_BITS && p < (1 << pos_bits) - 1);
    debug_assert_eq!(free_limit, 1 << (31 - pos_bits));
    if a.sum_free >= free_limit {
        return None;
    }
    debug_assert!(a.sum_free <= a.capacity, "room beyond capacity: {a:?}");
    let share = fixed_share(a.sum_free, a.capacity.max(1)) as u64;
    Some((share << 31) | (a.sum_free << pos_bits) | (!(p as u64) & ((1 << pos_bits) - 1)))
}

/// The largest `sum_free` a key holds exactly: `2^63 - 1`. A domain's
/// `sum_free` is at most its capacity, a sum of `u32` leaf capacities,
/// so it stays below this unless the topology has 2^31 leaves or more.
const SUM_FREE_MAX: u64 = (1 << 63) - 1;

/// `find_idlest`'s order of children as one integer, larger first: the
/// free share `sum_free / capacity` in 32.32 fixed point (at most `1 <<
/// 32`: a leaf's room never exceeds its capacity, and a capacity of 0 has
/// no room; 33 bits, from bit 95), then `sum_free` (63 bits, from bit 32),
/// then the child's position `p` in reverse (`!p`, 32 bits: the first in
/// child order wins ties). Comparing keys compares `(share, sum_free,
/// -p)` lexicographically. Every child's key is at least 1 (`!p > 0`, a
/// position being below `u32::MAX`), above the padding's 0.
fn order_key(a: &NodeAgg, p: u32) -> u128 {
    debug_assert!(a.sum_free <= a.capacity, "room beyond capacity: {a:?}");
    debug_assert!(a.sum_free <= SUM_FREE_MAX, "sum_free beyond the key: {a:?}");
    (fixed_share(a.sum_free, a.capacity.max(1)) << 95)
        | ((a.sum_free.min(SUM_FREE_MAX) as u128) << 32)
        | (!p) as u128
}

/// The child position a key names ([`order_key`]).
#[inline]
fn position_of(key: u128) -> usize {
    (!(key as u32)) as usize
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

    use super::*;
    use crate::alloc::FreeSummary;
    use crate::config::SchedConfig;
    use crate::sched::Sched;
    use crate::task::{TaskId, TaskSpec, TaskState};

    /// Fanouts that are and are not powers of two, several levels deep.
    const TOPOLOGIES: &[&str] = &[
        "2z:2r:3n",
        "3z:1r:7n",
        "2z:3r:5n:2h",
        "1s:2c:2t",
        "1z:1r:17n",
    ];
    /// Wider domains for the trees alone: 7 and 6 levels of children.
    const WIDE: &[&str] = &["1z:1r:70n", "2z:2r:33n"];
    const TASKS: u64 = 24;

    /// Every domain's choice from the index equals the scan it replaced
    /// (`Sched::idlest_child_scan`), for every alignment and every demand
    /// from 0 to one past the largest capacity.
    fn check_all(s: &Sched, max_cap: u32) -> Result<(), TestCaseError> {
        let topo = s.topology().clone();
        let skip_busy = s.config().busy_skip;
        for d in 0..topo.nodes().len() {
            if topo.node(d).is_leaf() {
                continue;
            }
            let (full_keys, full_rooms) = s.idlest.full_trees(d);
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
                    // The search over every other level examines what the
                    // search over every level examined (schedstats).
                    let mut binary = 0;
                    let oracle = binary_search(
                        &full_keys,
                        &full_rooms,
                        s.idlest.width[d] as usize,
                        topo.children(d),
                        align,
                        demand,
                        |c| !(skip_busy && s.busy_flags().is_busy(c)),
                        &mut binary,
                    );
                    prop_assert_eq!(oracle, want);
                    prop_assert_eq!(
                        searched,
                        binary,
                        "domain {} {:?} demand {}",
                        d,
                        align,
                        demand
                    );
                    prop_assert!(visited <= topo.node(d).nr_children() as u64);
                }
            }
        }
        Ok(())
    }

    /// The best-first search over a binary tree with every level stored
    /// (`full`, from [`IdlestIndex::full_trees`]), as the index searched
    /// before it kept every other level: the oracle of the children the
    /// search examines.
    #[allow(clippy::too_many_arguments)]
    fn binary_search(
        keys: &[u128],
        rooms: &[Maxima],
        w: usize,
        children: &[NodeId],
        align: Align,
        demand: u32,
        eligible: impl Fn(NodeId) -> bool,
        visited: &mut u64,
    ) -> Option<NodeId> {
        let mut found: Option<u128> = None;
        let mut stack = vec![1usize];
        while let Some(i) = stack.pop() {
            let key = keys[i];
            if key == 0 || value(rooms[i][align.index()]) < demand {
                continue;
            }
            if found.is_some_and(|f| key <= f) {
                continue;
            }
            if i >= w {
                *visited += 1;
                if eligible(children[position_of(key)]) {
                    found = Some(key);
                }
                continue;
            }
            let (l, r) = (2 * i, 2 * i + 1);
            if keys[r] > keys[l] {
                stack.extend([l, r]);
            } else {
                stack.extend([r, l]);
            }
        }
        found.map(|k| children[position_of(k)])
    }

    /// A random aggregate with room at most its capacity (any `u32`
    /// capacity up to the edges, so shares and sums tie and reach 1).
    fn agg(cap: u32, free: u32, rooms: [u32; 6]) -> NodeAgg {
        let cap = cap as u64;
        let sum_free = (free as u64).min(cap);
        let f = sum_free as u32;
        NodeAgg {
            capacity: cap,
            nr_running: 0,
            sum_free,
            max_free: rooms[5].min(f),
            max_room: [0, 1, 2, 3, 4].map(|i| rooms[i].min(f)),
        }
    }

    /// Every domain's first child in key order by brute force: the largest
    /// `(share, sum_free)`, the first on ties, as the u128 key of the
    /// previous index had it (`share << 64 | sum_free`).
    fn best_by_scan(aggs: &[NodeAgg], children: &[usize]) -> usize {
        let key =
            |a: &NodeAgg| (fixed_share(a.sum_free, a.capacity.max(1)) << 64) | a.sum_free as u128;
        let mut best = 0;
        for (i, &c) in children.iter().enumerate() {
            if key(&aggs[c]) > key(&aggs[children[best]]) {
                best = i;
            }
        }
        best
    }

    /// Every segment of every domain as the search reads it equals the
    /// binary join of the children (every level computed, `full_trees`),
    /// and every stored slot holds it, in whichever widths the index
    /// holds its trees.
    fn check_segments(ix: &IdlestIndex) -> Result<(), TestCaseError> {
        match (&ix.keys, &ix.rooms) {
            (Keys::Narrow(k), Rooms::Narrow(r)) => check_segments_in(ix, k, r),
            (Keys::Narrow(k), Rooms::Wide(r)) => check_segments_in(ix, k, r),
            (Keys::Wide(k), Rooms::Narrow(r)) => check_segments_in(ix, k, r),
            (Keys::Wide(k), Rooms::Wide(r)) => check_segments_in(ix, k, r),
        }
    }

    fn check_segments_in<K: Key, L: Lanes>(
        ix: &IdlestIndex,
        keys_of: &[K],
        rooms_of: &[L],
    ) -> Result<(), TestCaseError> {
        let p = ix.pos_bits;
        for d in 0..ix.width.len() {
            let (b, w) = (ix.base[d] as usize, ix.width[d] as usize);
            if w == 0 {
                continue;
            }
            let (keys, rooms) = ix.full_trees(d);
            let end = b + ix.kept(d);
            prop_assert!(ix.kept(d) <= tree_len(w) && ix.kept(d).is_multiple_of(4));
            let tree = Tree {
                keys: keys_of,
                rooms: rooms_of,
                base: b,
                width: w,
                pos_bits: p,
            };
            // The segments the search can read (`kept_len`): every one but
            // those of the children's level and the level above it past
            // the kept slots, which are padding (their first child slot is
            // not kept, and none of their children is a child).
            let kept = ix.kept(d);
            let read = |i: usize| {
                if i >= w {
                    slot(i) < kept
                } else if i >= w / 2 {
                    slot(2 * i) < kept
                } else {
                    true
                }
            };
            for i in (1..2 * w).filter(|&i| !read(i)) {
                prop_assert_eq!(keys[i], 0, "domain {} slot {} past the kept slots", d, i);
            }
            for i in (1..2 * w).filter(|&i| read(i)) {
                prop_assert_eq!(tree.key(i).wide(p), keys[i], "domain {} slot {}", d, i);
                for align in Align::ALL {
                    let (k, room) = tree.segment(i, align);
                    prop_assert_eq!((k.wide(p), room), (keys[i], value(rooms[i][align.index()])));
                }
                if stored(i, w) {
                    prop_assert!(b + slot(i) < end);
                    prop_assert_eq!(keys_of[b + slot(i)].wide(p), keys[i]);
                    prop_assert_eq!(
                        values(&rooms_of[b + slot(i)]),
                        values(&rooms[i]),
                        "domain {} slot {}",
                        d,
                        i
                    );
                }
            }
        }
        Ok(())
    }

    /// A domain keeps every child's slot and at most three slots past the
    /// last one, in whole groups of four, never more than its whole trees.
    #[test]
    fn kept_slots_end_at_the_last_group_with_a_child() {
        for l in 1..13 {
            let w = 1usize << l;
            for nr in (w / 2).max(1)..=w {
                let kept = kept_len(w, nr);
                let last = slot(w + nr - 1);
                assert!(
                    kept.is_multiple_of(4) && kept <= tree_len(w),
                    "w {w} nr {nr}"
                );
                assert!(last < kept && kept - last <= 4, "w {w} nr {nr}: {kept}");
                // What goes is whole groups of children slots, all padding.
                assert_eq!(tree_len(w) - kept, w - nr.next_multiple_of(4).min(w));
            }
        }
    }

    /// The stored segments of a domain's binary tree, level after level
    /// from the root and in order within a level, are slots 0, 1, ...,
    /// `tree_len(w) - 1` ([`slot`]), and the climb's step from a level to
    /// the one two above matches [`slot`] there.
    #[test]
    fn slots_are_the_stored_segments_in_order() {
        for l in 1..16 {
            let w = 1usize << l;
            let mut next = 1usize;
            let mut level = 0;
            for i in 1..2 * w {
                if stored(i, w) {
                    // A new level starts at the next multiple of four (the
                    // root at 1, level 1 of an odd tree right after it).
                    if i.ilog2() != level && i.ilog2() >= 2 {
                        next = next.next_multiple_of(4);
                    }
                    level = i.ilog2();
                    assert_eq!(slot(i), next, "w {w} segment {i}");
                    next += 1;
                }
            }
            assert_eq!(tree_len(w), next, "w {w}");
            assert_eq!(tree_len(w) % 4, 0, "w {w}");
            // At most three slots unused (before and after the root).
            let nr_stored = (1..2 * w).filter(|&i| stored(i, w)).count();
            assert!(tree_len(w) - nr_stored <= 3, "w {w}");
            // From every child slot, `climb`'s groups and steps up match
            // `slot` on every stored level.
            for pos in 0..w {
                let Climb { leaf, mut off, .. } = Climb::new(0, w, pos);
                let mut i = leaf;
                assert_eq!(4 * (i / 4 - off / 4) + i % 4, slot(i), "w {w} child {pos}");
                while i >= 4 {
                    assert_eq!(4 * (i / 4 - off / 4), slot(i & !3), "w {w} segment {i}");
                    i /= 4;
                    off = (off + 2) / 4;
                    assert_eq!(4 * (i / 4 - off / 4) + i % 4, slot(i), "w {w} segment {i}");
                }
            }
        }
    }

    proptest! {
        /// A 64-bit key orders aggregates as the 128-bit [`order_key`]
        /// does, gives it back (`Key::wide`) and names the position, for
        /// every width of positions, and exists exactly when `sum_free`
        /// fits the bits left.
        #[test]
        fn narrow_key_orders_as_order_key(
            pos_bits in 1u32..=MAX_POS_BITS,
            x in (0u64..8, 0u64..8, any::<u32>(), 0u8..3),
            y in (0u64..8, 0u64..8, any::<u32>(), 0u8..3),
        ) {
            let limit = 1u64 << (31 - pos_bits);
            // Capacities and free room at small values, around the limit
            // (equal shares at different sums, ties) and random.
            let pick = |(cap, free, p, near): (u64, u64, u32, u8)| {
                let capacity = match near {
                    0 => cap,
                    1 => (limit.saturating_sub(4) + cap).max(1),
                    _ => (limit.saturating_sub(4) + cap) * 3,
                };
                let sum_free = capacity.min(match near {
                    0 => free,
                    1 => limit.saturating_sub(4) + free,
                    _ => (limit.saturating_sub(4) + free) / 2,
                });
                let agg = NodeAgg { capacity, sum_free, ..NodeAgg::default() };
                (agg, p % ((1 << pos_bits) - 1))
            };
            let ((a, p), (b, q)) = (pick(x), pick(y));
            let (na, nb) = (
                narrow_key(&a, p, pos_bits, limit),
                narrow_key(&b, q, pos_bits, limit),
            );
            prop_assert_eq!(na.is_some(), a.sum_free < limit);
            prop_assert_eq!(nb.is_some(), b.sum_free < limit);
            if let (Some(na), Some(nb)) = (na, nb) {
                prop_assert_eq!(na.cmp(&nb), order_key(&a, p).cmp(&order_key(&b, q)));
                prop_assert_eq!(na.wide(pos_bits), order_key(&a, p));
                prop_assert_eq!(na.position(pos_bits), p as usize);
                prop_assert!(na > 0);
            }
        }

        /// The key trees in 64 bits against the same trees held in 128
        /// bits from the start (`widen_keys`): random aggregates with
        /// `sum_free` below, at and beyond what 64-bit keys hold, given
        /// to both, one child at a time; after each, the same keys (in
        /// 128 bits), the same choice and the same children examined for
        /// every domain, alignment and demand, every segment the join of
        /// its children, every domain's root the child a brute-force scan
        /// picks; the index widens exactly at the first key that does not
        /// fit.
        #[test]
        fn narrow_keys_match_wide_keys(
            topo in prop::sample::select([TOPOLOGIES, WIDE].concat()),
            values_in in prop::collection::vec(
                (0u64..6, 0u64..6, prop::array::uniform6(0u32..4),
                 prop::sample::select(vec![0u8, 0, 0, 1, 1, 2])),
                1..60),
            nodes in prop::collection::vec(0usize..1000, 60),
        ) {
            let t = Topology::from_spec(topo).unwrap();
            let n = t.nodes().len();
            let mut ix = IdlestIndex::new(&t);
            prop_assert!(matches!(ix.keys, Keys::Narrow(_)));
            let mut wide = IdlestIndex::new(&t);
            wide.widen_keys();
            let limit = 1u64 << (31 - ix.pos_bits);
            let mut aggs = vec![NodeAgg::default(); n];
            let mut big = false;
            for (k, &(cap, free, rooms, near)) in values_in.iter().enumerate() {
                let c = nodes[k] % n;
                // Near the limit: capacities and sums just below, at and
                // past it (1); far past it (2).
                let (capacity, sum_free) = match near {
                    0 => (cap, free.min(cap)),
                    1 => (limit - 3 + cap, (limit - 3 + free).min(limit - 3 + cap)),
                    _ => (limit * 4 + cap, limit * 2 + free),
                };
                let f = sum_free.min(u32::MAX as u64) as u32;
                aggs[c] = NodeAgg {
                    capacity,
                    nr_running: 0,
                    sum_free,
                    max_free: rooms[5].min(f),
                    max_room: [0, 1, 2, 3, 4].map(|i| rooms[i].min(f)),
                };
                big |= t.node(c).parent().is_some() && sum_free >= limit;
                prop_assert_eq!(ix.update(c, &aggs[c]), wide.update(c, &aggs[c]));
                prop_assert_eq!(matches!(ix.keys, Keys::Wide(_)), big);
                prop_assert_eq!(ix.wide_keys(), wide.wide_keys());
                check_segments(&ix)?;
                for d in 0..n {
                    let children = t.children(d);
                    if children.is_empty() {
                        continue;
                    }
                    let root = ix.wide_keys()[ix.base[d] as usize + 1];
                    prop_assert_eq!(position_of(root), best_by_scan(&aggs, children));
                    for align in Align::ALL {
                        for demand in [0, 1, 2, 3, 4] {
                            let (mut v1, mut v2) = (0, 0);
                            let even = |c: NodeId| c.is_multiple_of(2);
                            prop_assert_eq!(
                                ix.idlest_child(&t, d, align, demand, |_| true, &mut v1),
                                wide.idlest_child(&t, d, align, demand, |_| true, &mut v2)
                            );
                            prop_assert_eq!(
                                ix.search(&t, d, align, demand, even, &mut v1),
                                wide.search(&t, d, align, demand, even, &mut v2)
                            );
                            prop_assert_eq!(v1, v2);
                        }
                    }
                }
            }
        }

        /// The room trees in 16-bit lanes ([`Narrow`]) against the same
        /// trees held in 32-bit lanes from the start (`widen`): random
        /// aggregates with maxima up to and across 2^16 given to both, one
        /// child at a time; after each, the same maxima returned, the
        /// same slots (as values), the same choice and the same children
        /// examined for every domain, alignment and demand around the
        /// values; the index widens exactly when a value needs 17 bits.
        #[test]
        fn narrow_rooms_match_wide_rooms(
            topo in prop::sample::select([TOPOLOGIES, WIDE].concat()),
            values_in in prop::collection::vec(
                (prop::sample::select(vec![0u32, 1, 2, 8, 64, 65_535, 65_536, 200_000]),
                 prop::sample::select(vec![0u32, 1, 2, 3, 7, 8, 64, 65_535, 65_536]),
                 prop::array::uniform6(prop::sample::select(vec![
                     0u32, 1, 2, 3, 7, 9, 64, 32_767, 32_768, 65_534, 65_535,
                 ])),
                 prop::sample::select(vec![false, false, false, true])),
                1..80),
            nodes in prop::collection::vec(0usize..1000, 80),
        ) {
            let t = Topology::from_spec(topo).unwrap();
            let n = t.nodes().len();
            let mut ix = IdlestIndex::new(&t);
            let mut wide = IdlestIndex::new(&t);
            wide.widen();
            let mut big = false;
            for (k, &(cap, free, mut rooms, beyond)) in values_in.iter().enumerate() {
                let c = nodes[k] % n;
                if beyond {
                    // One lane past 16 bits (when the room allows it).
                    rooms[k % 6] = 65_536;
                }
                let a = agg(cap, free, rooms);
                // A root is in no trees (`update` returns at once).
                big |= t.node(c).parent().is_some() && !fits_narrow(&a);
                prop_assert_eq!(ix.update(c, &a), wide.update(c, &a));
                prop_assert_eq!(matches!(ix.rooms, Rooms::Wide(_)), big);
                prop_assert_eq!(ix.wide_keys(), wide.wide_keys());
                prop_assert_eq!(ix.wide_rooms(), wide.wide_rooms());
                check_segments(&ix)?;
                for d in 0..n {
                    prop_assert_eq!(ix.maxima(d), wide.maxima(d));
                    for align in Align::ALL {
                        for demand in [0, 1, 2, 8, 9, 64, 65, 65_535, 65_536, 65_537] {
                            let (mut v1, mut v2) = (0, 0);
                            let even = |c: NodeId| c.is_multiple_of(2);
                            prop_assert_eq!(
                                ix.idlest_child(&t, d, align, demand, |_| true, &mut v1),
                                wide.idlest_child(&t, d, align, demand, |_| true, &mut v2)
                            );
                            prop_assert_eq!(
                                ix.search(&t, d, align, demand, even, &mut v1),
                                wide.search(&t, d, align, demand, even, &mut v2)
                            );
                            prop_assert_eq!(v1, v2);
                        }
                    }
                }
            }
        }

        /// Random aggregates given to `update`, one child at a time: both
        /// trees equal a rebuild of every segment from the children's
        /// slots (each climb stopped early exactly where nothing above
        /// changes), every domain's root names the child a scan of the
        /// `(share, sum_free)` order picks (ties to the first), and its
        /// maxima are the children's.
        #[test]
        fn trees_equal_their_rebuild(
            topo in prop::sample::select([TOPOLOGIES, WIDE].concat()),
            values in prop::collection::vec(
                (prop::sample::select(vec![0u32, 1, 2, 3, 7, 8, 64, u32::MAX - 1, u32::MAX]),
                 prop::sample::select(vec![0u32, 1, 2, 3, 4, 7, 8, 64, u32::MAX]),
                 // Rooms on both sides of 2^31, where a lane's sign flips.
                 prop::array::uniform6(prop::sample::select(vec![
                     0u32, 1, 2, 3, 7, 9, (1 << 31) - 1, 1 << 31, u32::MAX - 1, u32::MAX,
                 ]))),
                1..120),
            nodes in prop::collection::vec(0usize..1000, 120),
        ) {
            let t = Topology::from_spec(topo).unwrap();
            let n = t.nodes().len();
            let mut ix = IdlestIndex::new(&t);
            let mut aggs = vec![NodeAgg::default(); n];
            for (k, &(cap, free, rooms)) in values.iter().enumerate() {
                let c = nodes[k] % n;
                aggs[c] = agg(cap, free, rooms);
                let maxima = ix.update(c, &aggs[c]);
                if let Some(p) = t.node(c).parent() {
                    prop_assert_eq!(maxima, Some(ix.maxima(p)));
                } else {
                    prop_assert_eq!(maxima, None);
                }
                // Every segment as the search reads it equals the binary
                // join of the children (every level computed), and every
                // stored slot holds it.
                check_segments(&ix)?;
                for d in 0..n {
                    let children = t.children(d);
                    if children.is_empty() {
                        continue;
                    }
                    let root = ix.wide_keys()[ix.base[d] as usize + 1];
                    prop_assert_eq!(position_of(root), best_by_scan(&aggs, children));
                    let (room, free) = ix.maxima(d);
                    for (i, &r) in room.iter().enumerate() {
                        prop_assert_eq!(r, children.iter().map(|&c| aggs[c].max_room[i]).max().unwrap());
                    }
                    prop_assert_eq!(free, children.iter().map(|&c| aggs[c].max_free).max().unwrap());
                }
            }
        }

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
