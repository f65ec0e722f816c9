//! Aligned allocation: `k` idle leaves inside one domain of a chosen level
//! (same core, same LLC, same NUMA node, same package, or anywhere), and the
//! per-level free summary an agent reports so that the dispatcher knows what
//! a node can give a job with a given alignment.
//!
//! This is not in the seeds (the kernel places one task at a time); it is
//! what a batch scheduler adds on top (Slurm's task/affinity, Kubernetes'
//! topology manager). It uses the same notion of idle as the rest of the
//! engine (`RunQueue::is_idle`) and the same policies: *spread* takes the
//! best-fitting domain (fewest idle leaves that still hold the request, to
//! keep large holes for large jobs) and inside it one leaf per idle core
//! before second hardware threads; *pack* takes the lowest-numbered domain
//! with room and fills cores in order (seed 002's priority).

use crate::config::Policy;
use crate::sched::Sched;
use crate::task::LeafSet;
use crate::topology::{LeafId, Topology};

/// The domain a multi-leaf request must fit in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Align {
    /// Hardware threads of one core (cluster: one host group).
    Core,
    /// One last-level cache (cluster: one rack).
    Llc,
    /// One NUMA node (cluster: one zone).
    Numa,
    /// One package / socket.
    Package,
    /// Anywhere.
    #[default]
    Any,
}

impl Align {
    /// All levels, innermost first.
    pub const ALL: [Align; 5] = [
        Align::Core,
        Align::Llc,
        Align::Numa,
        Align::Package,
        Align::Any,
    ];

    /// Index in [`Align::ALL`].
    pub fn index(self) -> usize {
        match self {
            Align::Core => 0,
            Align::Llc => 1,
            Align::Numa => 2,
            Align::Package => 3,
            Align::Any => 4,
        }
    }

    /// Lower-case name ("core", "llc", "numa", "package", "any").
    pub fn name(self) -> &'static str {
        match self {
            Align::Core => "core",
            Align::Llc => "llc",
            Align::Numa => "numa",
            Align::Package => "package",
            Align::Any => "any",
        }
    }

    /// Parse a lower-case name.
    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.name() == name)
    }
}

/// The groups of leaves at an alignment level, each ascending, ranked by
/// lowest leaf.
pub fn align_groups(topo: &Topology, align: Align) -> Vec<&[LeafId]> {
    groups(topo, align).collect()
}

/// [`align_groups`] without collecting them (the placement path calls it
/// per job start and finish).
fn groups(topo: &Topology, align: Align) -> Groups<'_> {
    match align {
        Align::Core => Groups::Ranked(topo.cores().iter()),
        Align::Llc => Groups::Llcs(topo.llcs().iter()),
        Align::Numa => Groups::Ranked(topo.numa_groups().iter()),
        Align::Package => Groups::Ranked(topo.package_groups().iter()),
        Align::Any => Groups::One(Some(topo.span(topo.root()))),
    }
}

/// The iterator of [`groups`].
enum Groups<'a> {
    /// Cores, NUMA nodes or packages.
    Ranked(crate::topology::LeafGroupsIter<'a>),
    Llcs(std::slice::Iter<'a, crate::topology::Llc>),
    One(Option<&'a [LeafId]>),
}

impl<'a> Iterator for Groups<'a> {
    type Item = &'a [LeafId];

    fn next(&mut self) -> Option<&'a [LeafId]> {
        match self {
            Groups::Ranked(it) => it.next(),
            Groups::Llcs(it) => it.next().map(|l| l.members.as_slice()),
            Groups::One(g) => g.take(),
        }
    }
}

/// Idle leaves available per alignment level: for each level, the largest
/// number of idle leaves inside one domain of that level.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FreeSummary {
    /// Most idle leaves in one core.
    pub core: u32,
    /// Most idle leaves in one LLC.
    pub llc: u32,
    /// Most idle leaves in one NUMA node.
    pub numa: u32,
    /// Most idle leaves in one package.
    pub package: u32,
    /// Idle leaves in all.
    pub any: u32,
}

impl FreeSummary {
    /// The value for one level.
    pub fn get(&self, align: Align) -> u32 {
        match align {
            Align::Core => self.core,
            Align::Llc => self.llc,
            Align::Numa => self.numa,
            Align::Package => self.package,
            Align::Any => self.any,
        }
    }

    /// Make the levels consistent: a domain's room can never exceed the
    /// room of the domains enclosing it, so each level is capped by every
    /// wider one. Real summaries already satisfy this; reports from outside
    /// are normalised so that "no room anywhere" really means no room.
    pub fn normalized(mut self) -> Self {
        let mut cap = u32::MAX;
        for align in Align::ALL.into_iter().rev() {
            cap = cap.min(self.get(align));
            self.set(align, cap);
        }
        self
    }

    pub(crate) fn set(&mut self, align: Align, v: u32) {
        match align {
            Align::Core => self.core = v,
            Align::Llc => self.llc = v,
            Align::Numa => self.numa = v,
            Align::Package => self.package = v,
            Align::Any => self.any = v,
        }
    }
}

/// Idle leaves per alignment level of `topo`, where `is_idle` says which
/// leaves are idle: for the agent its own run queues, for the dispatcher
/// its model of a node's CPUs.
pub fn free_summary_of(topo: &Topology, is_idle: impl Fn(LeafId) -> bool) -> FreeSummary {
    let mut s = FreeSummary::default();
    for align in Align::ALL {
        let best = groups(topo, align)
            .map(|g| g.iter().filter(|&&l| is_idle(l)).count() as u32)
            .max()
            .unwrap_or(0);
        s.set(align, best);
    }
    s
}

impl Sched {
    /// Idle leaves per alignment level (what the agent reports).
    pub fn free_summary(&self) -> FreeSummary {
        free_summary_of(&self.topo, |l| self.rqs[l].is_idle())
    }

    /// Choose `k` idle leaves inside one domain of level `align`, allowed by
    /// `allowed` (all when `None`), by `policy`; `None` when no domain has
    /// room (the request waits).
    pub fn find_aligned(
        &self,
        k: usize,
        align: Align,
        policy: Policy,
        allowed: Option<&LeafSet>,
    ) -> Option<Vec<LeafId>> {
        find_aligned_in(&self.topo, k, align, policy, allowed, |l| {
            self.rqs[l].is_idle()
        })
    }
}

/// [`Sched::find_aligned`] over any idle predicate (the dispatcher's model
/// of a node's CPUs uses it without an engine per node).
pub fn find_aligned_in(
    topo: &Topology,
    k: usize,
    align: Align,
    policy: Policy,
    allowed: Option<&LeafSet>,
    is_idle: impl Fn(LeafId) -> bool,
) -> Option<Vec<LeafId>> {
    if k == 0 {
        return Some(Vec::new());
    }
    let ok = |l: LeafId| is_idle(l) && allowed.is_none_or(|a| a.contains(l));
    if let Some(masks) = topo.leaf_masks() {
        let free = (0..topo.nr_leaves())
            .filter(|&l| ok(l))
            .fold(0u64, |m, l| m | 1 << l);
        return masks.find_aligned(k, align, policy, free);
    }
    find_aligned_scan(topo, k, align, policy, &ok)
}

/// [`find_aligned_in`] with every leaf allowed and the busy leaves given
/// as a bitmap: leaf `l` is busy when bit `l % 64` of `busy[l / 64]` is
/// set (a missing word: idle). The same choice; on a machine of at most
/// 64 leaves the free mask is one word operation instead of a call per
/// leaf (the dispatcher's CPU model claims on every job start).
pub fn find_aligned_in_bits(
    topo: &Topology,
    k: usize,
    align: Align,
    policy: Policy,
    busy: &[u64],
) -> Option<Vec<LeafId>> {
    if k == 0 {
        return Some(Vec::new());
    }
    if let Some(masks) = topo.leaf_masks() {
        let n = topo.nr_leaves();
        let all = if n >= 64 { u64::MAX } else { (1u64 << n) - 1 };
        let free = !busy.first().copied().unwrap_or(0) & all;
        return masks.find_aligned(k, align, policy, free);
    }
    let idle = |l: LeafId| busy.get(l / 64).is_none_or(|w| w & (1 << (l % 64)) == 0);
    find_aligned_scan(topo, k, align, policy, &idle)
}

/// Cores and alignment groups of a machine of at most 64 leaves as bit
/// masks (bit `l` = leaf `l`), so that [`find_aligned_in`] counts a
/// group's or a core's idle leaves by a popcount instead of a walk
/// (the dispatcher's CPU model claims on every job start).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeafMasks {
    /// `cores[c]`: the leaves of core `c` ([`Topology::cores`] order).
    cores: Vec<u64>,
    /// Per level in [`Align::ALL`] order: its groups, in `align_groups`
    /// order.
    groups: [Vec<u64>; 5],
    /// `Some(t)` when the cores are regular: core `c` is the `t` leaves
    /// from `c * t` (as a spec-built machine's are), so the spread finds
    /// the whole free cores and the partly free ones by shifts of the
    /// free mask instead of a test per core ([`Regular`]).
    regular: Option<Regular>,
}

/// The cores of a machine laid out regularly: core `c` is core 0's
/// leaves shifted by `c * step`, and core 0 is the `t` leaves `j *
/// stride` (`j < t`). Both usual numberings are: a spec-built machine's
/// (Linux's, the threads of core `c` are `c`, `c + ncores`, ...: `step`
/// 1, `stride` the number of cores) and runs of consecutive leaves
/// (`step` `t`, `stride` 1). See [`LeafMasks::regular`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Regular {
    /// Leaves per core (1 to 64).
    t: u32,
    /// Distance between a core's consecutive leaves.
    stride: u32,
    /// Core 0's leaves.
    first: u64,
    /// The first leaf of every core, one bit each.
    starts: u64,
}

impl Regular {
    /// Whether `cores` (masks, in core order) are laid out regularly.
    fn of(cores: &[u64]) -> Option<Self> {
        let first = *cores.first()?;
        let t = first.count_ones();
        if first & 1 == 0 {
            return None;
        }
        let rest = first & (first - 1);
        let stride = if rest == 0 { 1 } else { rest.trailing_zeros() };
        let mut run = 0u64;
        for j in 0..t {
            let at = j * stride;
            if at >= 64 {
                return None;
            }
            run |= 1 << at;
        }
        if run != first {
            return None;
        }
        let step = cores.get(1).map_or(1, |c| c.trailing_zeros());
        let mut starts = 0;
        for (c, &m) in cores.iter().enumerate() {
            let s = c as u64 * step as u64;
            if s >= 64 || m != first << s || (first << s).count_ones() != t {
                return None;
            }
            starts |= 1 << s;
        }
        Some(Self {
            t,
            stride,
            first,
            starts,
        })
    }

    /// The spread's first step on regular cores: the free leaves (of
    /// `free`) of each core that has some, whole free cores first, each
    /// kind in core order, the first `k` (at most `N`) of them into
    /// `left`; returns how many. What the test per core finds
    /// ([`collect_cores`]) by shifts of the free mask: a core's first
    /// leaf is set in `whole` when all its leaves are free, in `some`
    /// when any is.
    fn collect<const N: usize>(&self, free: u64, k: usize, left: &mut [u64; N]) -> usize {
        let (mut whole, mut some) = (free, free);
        for j in 1..self.t {
            let f = free >> (j * self.stride);
            whole &= f;
            some |= f;
        }
        whole &= self.starts;
        some &= self.starts & !whole;
        let mut n = 0;
        for mut m in [whole, some] {
            while m != 0 {
                if n == k || n == N {
                    return n;
                }
                left[n] = free & (self.first << m.trailing_zeros());
                n += 1;
                m &= m - 1;
            }
        }
        n
    }
}

impl LeafMasks {
    /// The masks of `topo`; `None` above 64 leaves.
    pub fn of(topo: &Topology) -> Option<Self> {
        if topo.nr_leaves() > 64 {
            return None;
        }
        let mask = |g: &[LeafId]| g.iter().fold(0u64, |m, &l| m | 1 << l);
        Some(Self {
            cores: topo.cores().iter().map(&mask).collect(),
            groups: Align::ALL.map(|a| groups(topo, a).map(mask).collect()),
            regular: None,
        })
        .map(|mut m| {
            m.regular = Regular::of(&m.cores);
            m
        })
    }

    /// [`find_aligned_in`] with the allowed idle leaves given as the mask
    /// `free`: the same choice as the walk ([`find_aligned_scan`]), group
    /// and core counts by popcount. Spread: best fit among the groups
    /// (fewest free leaves that hold `k`, first on ties), then round by
    /// round the lowest free leaf left of each core, whole free cores
    /// first, each in core order; pack: the first group with room, then
    /// the free leaves core by core.
    fn find_aligned(
        &self,
        k: usize,
        align: Align,
        policy: Policy,
        free: u64,
    ) -> Option<Vec<LeafId>> {
        let mut best: Option<(u32, u64)> = None;
        for &g in &self.groups[align.index()] {
            let n = (g & free).count_ones();
            if (n as usize) < k {
                continue;
            }
            match policy {
                Policy::Pack => {
                    best = Some((n, g));
                    break;
                }
                Policy::Spread => {
                    if best.is_none_or(|(b, _)| n < b) {
                        best = Some((n, g));
                    }
                }
            }
        }
        let (_, group) = best?;
        let free = group & free;
        let mut out = Vec::with_capacity(k);
        match policy {
            Policy::Pack => {
                for &c in &self.cores {
                    let mut left = c & free;
                    while left != 0 {
                        out.push(left.trailing_zeros() as LeafId);
                        if out.len() == k {
                            return Some(out);
                        }
                        left &= left - 1;
                    }
                }
            }
            // `k` cores are enough: a small job's round-robin keeps its
            // cores in 8 words, not 64 zeroed on every claim.
            Policy::Spread if k <= 8 => self.spread::<8>(free, k, &mut out),
            Policy::Spread => self.spread::<64>(free, k, &mut out),
        }
        (out.len() == k).then_some(out)
    }
}

impl LeafMasks {
    /// [`LeafMasks::find_aligned`]'s spread within the chosen group
    /// (`free`, its free leaves): the free leaves of each core with one,
    /// whole cores first, the first `k` of them (the first round takes one
    /// leaf of each); then one leaf per core per round, in that order,
    /// until `out` holds `k`. `N` must be at least `k` or the number of
    /// cores (at most 64).
    fn spread<const N: usize>(&self, free: u64, k: usize, out: &mut Vec<LeafId>) {
        let mut left = [0u64; N];
        let n = match self.regular {
            Some(r) => r.collect(free, k, &mut left),
            None => collect_cores(&self.cores, free, k, &mut left),
        };
        take_rounds(&mut left[..n], k, out);
    }
}

/// The spread's first step on any cores ([`LeafMasks::spread`]): a test
/// per core, whole free cores in a first pass, partly free ones in a
/// second, until `k` (at most `N`).
fn collect_cores<const N: usize>(cores: &[u64], free: u64, k: usize, left: &mut [u64; N]) -> usize {
    let mut n = 0;
    for whole_pass in [true, false] {
        for &c in cores {
            let f = c & free;
            if f != 0 && (f == c) == whole_pass {
                if n == k || n == N {
                    return n;
                }
                left[n] = f;
                n += 1;
            }
        }
    }
    n
}

/// The spread's rounds ([`LeafMasks::spread`]): one leaf of each core of
/// `left` per round, the lowest left, until `out` holds `k`.
fn take_rounds(left: &mut [u64], k: usize, out: &mut Vec<LeafId>) {
    loop {
        let before = out.len();
        for f in left.iter_mut() {
            if *f != 0 {
                out.push(f.trailing_zeros() as LeafId);
                if out.len() == k {
                    return;
                }
                *f &= *f - 1;
            }
        }
        if out.len() == before {
            return;
        }
    }
}

/// [`find_aligned_in`] by walking the leaves (any size of machine; the
/// only path above 64 leaves).
fn find_aligned_scan(
    topo: &Topology,
    k: usize,
    align: Align,
    policy: Policy,
    ok: &impl Fn(LeafId) -> bool,
) -> Option<Vec<LeafId>> {
    if k == 0 {
        return Some(Vec::new());
    }
    let mut best: Option<(usize, &[LeafId])> = None;
    for group in groups(topo, align) {
        let idle = group.iter().filter(|&&l| ok(l)).count();
        if idle < k {
            continue;
        }
        match policy {
            Policy::Pack => {
                best = Some((idle, group));
                break;
            }
            Policy::Spread => {
                if best.is_none_or(|(b, _)| idle < b) {
                    best = Some((idle, group));
                }
            }
        }
    }
    let (idle, group) = best?;
    if group.len() == topo.nr_leaves() {
        // The group is every leaf (`Any`, or a single package): the cores
        // in number order, each ascending, are the order below already,
        // so the cores are walked in place (no `keyed` / `by_core`: the
        // common case of a cluster node's CPU model).
        return whole_topology(topo, k, policy, ok);
    }
    // Leaves of the group, core by core in rank order: `keyed` sorted by
    // (core, leaf), packed in one u64 each so that the sort compares
    // integers (the keys are distinct: unstable is stable here; the leaf
    // is the low half), and `by_core` the range of each core in it (one
    // allocation each, not one per core).
    let mut keyed: Vec<u64> = Vec::with_capacity(idle);
    keyed.extend(
        group
            .iter()
            .filter(|&&l| ok(l))
            .map(|&l| ((topo.core_of(l) as u64) << 32) | l as u64),
    );
    keyed.sort_unstable();
    let leaf = |i: usize| keyed[i] as u32 as LeafId;
    let mut by_core: Vec<std::ops::Range<usize>> = Vec::with_capacity(keyed.len());
    let mut last_core = u64::MAX;
    for (i, &key) in keyed.iter().enumerate() {
        let core = key >> 32;
        if core != last_core {
            by_core.push(i..i);
            last_core = core;
        }
        if let Some(r) = by_core.last_mut() {
            r.end = i + 1;
        }
    }
    let mut out = Vec::with_capacity(k);
    match policy {
        Policy::Pack => {
            out.extend((0..k.min(keyed.len())).map(leaf));
        }
        Policy::Spread => {
            // Whole idle cores first, one thread each, then the rest; each
            // in core order (`by_core` is: a stable partition, no sort).
            let whole =
                |r: &std::ops::Range<usize>| r.len() == topo.smt_siblings(leaf(r.start)).len();
            let ordered = || {
                let partial = by_core.iter().filter(move |r| !whole(r));
                by_core.iter().filter(move |r| whole(r)).chain(partial)
            };
            let mut round = 0;
            while out.len() < k {
                let before = out.len();
                for r in ordered() {
                    if round < r.len() {
                        out.push(leaf(r.start + round));
                        if out.len() == k {
                            break;
                        }
                    }
                }
                if out.len() == before {
                    break;
                }
                round += 1;
            }
        }
    }
    (out.len() == k).then_some(out)
}

/// [`find_aligned_in`] for a group of every leaf of `topo`, walking
/// `topo.cores()` in place: the same choice as building the (core, leaf)
/// order and the per-core ranges of idle leaves (cores in number order,
/// each ascending). Pack: the first `k` idle leaves. Spread: round by
/// round, the round-th idle leaf of each core that has one, whole idle
/// cores first, then the others, each in core order.
fn whole_topology(
    topo: &Topology,
    k: usize,
    policy: Policy,
    ok: &impl Fn(LeafId) -> bool,
) -> Option<Vec<LeafId>> {
    debug_assert!(topo.cores().iter().all(|m| m.is_sorted()));
    let mut out = Vec::with_capacity(k);
    match policy {
        Policy::Pack => {
            for members in topo.cores() {
                for &l in members {
                    if out.len() == k {
                        break;
                    }
                    if ok(l) {
                        out.push(l);
                    }
                }
            }
        }
        Policy::Spread => {
            let mut round = 0;
            'rounds: while out.len() < k {
                let before = out.len();
                for whole_pass in [true, false] {
                    for members in topo.cores() {
                        let idle = members.iter().filter(|&&l| ok(l)).count();
                        // A core with no idle leaf has no range at all.
                        if idle == 0 || (idle == members.len()) != whole_pass || round >= idle {
                            continue;
                        }
                        if let Some(&l) = members.iter().filter(|&&l| ok(l)).nth(round) {
                            out.push(l);
                        }
                        if out.len() == k {
                            break 'rounds;
                        }
                    }
                }
                if out.len() == before {
                    break;
                }
                round += 1;
            }
        }
    }
    (out.len() == k).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SchedConfig;
    use crate::task::{TaskId, TaskSpec};
    use std::sync::Arc;

    fn engine(spec: &str) -> Sched {
        Sched::new(
            Arc::new(Topology::from_spec(spec).unwrap()),
            1,
            SchedConfig::default(),
        )
    }

    fn occupy(s: &mut Sched, leaves: &[LeafId]) {
        for &l in leaves {
            let id = TaskId(s.nr_tasks() as u64);
            s.add_task(TaskSpec::new(id)).unwrap();
            s.wake_up_on(id, l, 0).unwrap();
        }
    }

    #[test]
    fn summary_per_level() {
        let mut s = engine("2s:4c:2t");
        // x86 numbering: core c = {c, c + 8}; socket 0 = cores 0..4.
        let f = s.free_summary();
        assert_eq!((f.core, f.llc, f.numa, f.package, f.any), (2, 8, 8, 8, 16));
        occupy(&mut s, &[0, 1, 2, 3, 8]);
        let f = s.free_summary();
        assert_eq!(f.core, 2, "cores of socket 1 are whole");
        assert_eq!(f.llc, 8);
        assert_eq!(f.any, 11);
        occupy(&mut s, &[4]);
        assert_eq!(s.free_summary().llc, 7);
    }

    #[test]
    fn aligned_requests_fit_one_domain_or_wait() {
        let mut s = engine("2s:4c:2t");
        occupy(&mut s, &[0, 1, 2, 4, 5]);
        // Socket 0 (cores 0-3 = CPUs 0-3, 8-11) has 3 busy, 5 idle.
        let idle0 = [0usize, 1, 2, 3, 8, 9, 10, 11]
            .iter()
            .filter(|&&l| s.rq(l).is_idle())
            .count();
        assert_eq!(idle0, 5);
        let got = s.find_aligned(6, Align::Llc, Policy::Spread, None).unwrap();
        assert!(
            got.iter().all(|&l| s.topology().llc_of(l) == 1),
            "only socket 1 holds 6"
        );
        assert_eq!(
            s.find_aligned(7, Align::Llc, Policy::Spread, None)
                .map(|v| v.len()),
            None
        );
        assert_eq!(
            s.find_aligned(9, Align::Any, Policy::Spread, None)
                .map(|v| v.len()),
            Some(9)
        );
        // Best fit: a 4-leaf request goes to the fuller socket 0 (5 idle).
        let got = s.find_aligned(4, Align::Llc, Policy::Spread, None).unwrap();
        assert!(got.iter().all(|&l| s.topology().llc_of(l) == 0));
        // A whole core.
        let core = s
            .find_aligned(2, Align::Core, Policy::Spread, None)
            .unwrap();
        assert_eq!(s.topology().core_of(core[0]), s.topology().core_of(core[1]));
    }

    #[test]
    fn spread_takes_idle_cores_first_pack_fills_cores() {
        let s = engine("1s:4c:2t");
        let spread = s.find_aligned(4, Align::Llc, Policy::Spread, None).unwrap();
        let cores: std::collections::HashSet<usize> =
            spread.iter().map(|&l| s.topology().core_of(l)).collect();
        assert_eq!(cores.len(), 4, "one thread per core: {spread:?}");
        let pack = s.find_aligned(4, Align::Llc, Policy::Pack, None).unwrap();
        assert_eq!(pack, vec![0, 4, 1, 5], "cores 0 and 1 filled");
    }

    #[test]
    fn normalized_caps_inner_levels_by_outer() {
        let s = FreeSummary {
            core: 2,
            llc: 9,
            numa: 4,
            package: 6,
            any: 5,
        }
        .normalized();
        assert_eq!((s.core, s.llc, s.numa, s.package, s.any), (2, 4, 4, 5, 5));
    }

    #[test]
    fn affinity_restricts() {
        let s = engine("1s:4c:1t");
        let allowed = LeafSet::from_leaves(4, [1, 3]);
        assert_eq!(
            s.find_aligned(2, Align::Any, Policy::Pack, Some(&allowed)),
            Some(vec![1, 3])
        );
        assert_eq!(
            s.find_aligned(3, Align::Any, Policy::Pack, Some(&allowed)),
            None
        );
        assert_eq!(Align::from_name("numa"), Some(Align::Numa));
        assert_eq!(Align::from_name("rack"), None);
    }

    /// The allocation as it was written before it was made cheaper (a
    /// `Vec` per core; `align_groups` collected): the oracle of the
    /// proptest below.
    fn find_aligned_oracle(
        topo: &Topology,
        k: usize,
        align: Align,
        policy: Policy,
        is_idle: impl Fn(LeafId) -> bool,
    ) -> Option<Vec<LeafId>> {
        if k == 0 {
            return Some(Vec::new());
        }
        let mut best: Option<(usize, &[LeafId])> = None;
        for group in align_groups(topo, align) {
            let idle = group.iter().filter(|&&l| is_idle(l)).count();
            if idle < k {
                continue;
            }
            match policy {
                Policy::Pack => {
                    best = Some((idle, group));
                    break;
                }
                Policy::Spread => {
                    if best.is_none_or(|(b, _)| idle < b) {
                        best = Some((idle, group));
                    }
                }
            }
        }
        let (_, group) = best?;
        let mut by_core: Vec<Vec<LeafId>> = Vec::new();
        let mut last_core = usize::MAX;
        let mut leaves: Vec<LeafId> = group.iter().copied().filter(|&l| is_idle(l)).collect();
        leaves.sort_by_key(|&l| (topo.core_of(l), l));
        for l in leaves {
            let core = topo.core_of(l);
            if core != last_core {
                by_core.push(Vec::new());
                last_core = core;
            }
            if let Some(v) = by_core.last_mut() {
                v.push(l);
            }
        }
        let mut out = Vec::with_capacity(k);
        match policy {
            Policy::Pack => out.extend(by_core.iter().flatten().copied().take(k)),
            Policy::Spread => {
                by_core.sort_by_key(|c| {
                    let core_size = topo.smt_siblings(c[0]).len();
                    (c.len() != core_size, topo.core_of(c[0]))
                });
                let mut round = 0;
                while out.len() < k {
                    let before = out.len();
                    for c in &by_core {
                        if let Some(&l) = c.get(round) {
                            out.push(l);
                            if out.len() == k {
                                break;
                            }
                        }
                    }
                    if out.len() == before {
                        break;
                    }
                    round += 1;
                }
            }
        }
        (out.len() == k).then_some(out)
    }

    /// A spec-built machine's cores are regular runs, so the spread takes
    /// the shift path; cores laid out otherwise (threads of a core apart)
    /// are not.
    #[test]
    fn spec_cores_are_regular_runs() {
        let topo = Topology::from_spec("2s:8c:2t").unwrap();
        let masks = topo.leaf_masks().unwrap();
        assert_eq!(
            masks.regular,
            Some(Regular {
                t: 2,
                stride: 16,
                first: 1 | 1 << 16,
                starts: 0xffff
            })
        );
        let runs = |t: u32, n: u32| {
            (0..n)
                .map(|c| (u64::MAX >> (64 - t)) << (c * t))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            Regular::of(&runs(2, 3)),
            Some(Regular {
                t: 2,
                stride: 1,
                first: 0b11,
                starts: 0b01_0101
            })
        );
        assert_eq!(
            Regular::of(&runs(64, 1)),
            Some(Regular {
                t: 64,
                stride: 1,
                first: u64::MAX,
                starts: 1
            })
        );
        // Not regular: a core of another width, out of order, a gap
        // inside core 0, a core beyond 64 leaves, none.
        assert_eq!(Regular::of(&[0b0011, 0b1100, 0b1_0000]), None);
        assert_eq!(Regular::of(&[0b1100, 0b0011]), None);
        assert_eq!(Regular::of(&[0b1011, 0b1_0000]), None);
        assert_eq!(
            Regular::of(&[1 << 0 | 1 << 32, 1 << 1 | 1 << 33]),
            Some(Regular {
                t: 2,
                stride: 32,
                first: 1 | 1 << 32,
                starts: 0b11
            })
        );
        assert_eq!(Regular::of(&[1 | 1 << 40, 1 << 30]), None);
        assert_eq!(Regular::of(&[]), None);
    }

    proptest::proptest! {
        /// The shift path of the spread's first step
        /// ([`Regular::collect`]) takes the cores the test per core
        /// ([`collect_cores`], the path of any layout) takes, in the same
        /// order, on regular cores of 1 to 8 leaves, for every `k`.
        #[test]
        fn regular_collect_matches_the_test_per_core(
            t in 1u32..9, ncores in 1u32..65, interleaved in proptest::bool::ANY,
            free in proptest::num::u64::ANY, k in 1usize..70,
        ) {
            let ncores = ncores.min(64 / t);
            // Runs of `t` leaves, or Linux's numbering (core `c`'s leaves
            // `c + j * ncores`).
            let (step, stride) = if interleaved { (1, ncores) } else { (t, 1) };
            let cores: Vec<u64> = (0..ncores)
                .map(|c| (0..t).fold(0u64, |m, j| m | 1 << (c * step + j * stride)))
                .collect();
            let r = Regular::of(&cores);
            proptest::prop_assert!(r.is_some());
            let r = r.unwrap();
            // A free mask with whole cores, partly free ones and bits
            // beyond the cores (the group's mask removes them in use).
            let (mut a, mut b) = ([0u64; 64], [0u64; 64]);
            let n = r.collect(free, k, &mut a);
            proptest::prop_assert_eq!(n, collect_cores(&cores, free, k, &mut b));
            proptest::prop_assert_eq!(&a[..n], &b[..n]);
            let (mut a, mut b) = ([0u64; 8], [0u64; 8]);
            let k8 = k.min(8);
            let n = r.collect(free, k8, &mut a);
            proptest::prop_assert_eq!(n, collect_cores(&cores, free, k8, &mut b));
            proptest::prop_assert_eq!(&a[..n], &b[..n]);
        }

        /// The allocation and the free summary give the oracle's answers
        /// (the previous implementation; the summary recomputed group by
        /// group from `align_groups`) on random machines and busy sets.
        #[test]
        fn allocation_matches_the_previous_implementation(
            sockets in 1usize..3, cores in 1usize..6, threads in 1usize..3,
            busy in proptest::collection::vec(proptest::bool::ANY, 36),
            k in 0usize..10, align in 0usize..5, pack in proptest::bool::ANY,
        ) {
            let topo = Topology::from_spec(&format!("{sockets}s:{cores}c:{threads}t")).unwrap();
            let idle = |l: LeafId| !busy[l % busy.len()];
            let (align, policy) = (Align::ALL[align], if pack { Policy::Pack } else { Policy::Spread });
            proptest::prop_assert_eq!(
                find_aligned_in(&topo, k, align, policy, None, idle),
                find_aligned_oracle(&topo, k, align, policy, idle)
            );
            proptest::prop_assert_eq!(
                find_aligned_scan(&topo, k, align, policy, &idle),
                find_aligned_oracle(&topo, k, align, policy, idle)
            );
            let summary = free_summary_of(&topo, idle);
            for a in Align::ALL {
                let most = align_groups(&topo, a)
                    .iter()
                    .map(|g| g.iter().filter(|&&l| idle(l)).count() as u32)
                    .max()
                    .unwrap_or(0);
                proptest::prop_assert_eq!(summary.get(a), most);
            }
        }

        /// The word scan (machines of up to 64 leaves) and the walk (any
        /// size) give the oracle's answer, with an affinity mask, on
        /// machines on both sides of 64 leaves.
        #[test]
        fn word_scan_and_walk_match_the_oracle(
            sockets in 1usize..5, cores in 1usize..17, threads in 1usize..4,
            busy in proptest::collection::vec(proptest::bool::ANY, 200),
            denied in proptest::collection::vec(proptest::bool::ANY, 0..200),
            k in 0usize..16, align in 0usize..5, pack in proptest::bool::ANY,
        ) {
            let topo = Topology::from_spec(&format!("{sockets}s:{cores}c:{threads}t")).unwrap();
            let n = topo.nr_leaves();
            proptest::prop_assert_eq!(topo.leaf_masks().is_some(), n <= 64);
            let allowed = (!denied.is_empty()).then(|| {
                LeafSet::from_leaves(n, (0..n).filter(|&l| !denied[l % denied.len()]))
            });
            let idle = |l: LeafId| !busy[l % busy.len()];
            let ok = |l: LeafId| idle(l) && allowed.as_ref().is_none_or(|a| a.contains(l));
            let (align, policy) = (Align::ALL[align], if pack { Policy::Pack } else { Policy::Spread });
            let want = find_aligned_oracle(&topo, k, align, policy, ok);
            proptest::prop_assert_eq!(
                &find_aligned_in(&topo, k, align, policy, allowed.as_ref(), idle),
                &want
            );
            proptest::prop_assert_eq!(&find_aligned_scan(&topo, k, align, policy, &ok), &want);
        }
    }
}
