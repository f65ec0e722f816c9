//! The parts of node records that nodes share: reported topologies, the
//! CPU shapes the dispatcher's CPU model counts by, label strings and
//! device lists. Each is kept once per distinct value and held by `Arc`;
//! a node keeps only what is its own (its free CPUs, its label set's
//! list of shared strings).
//!
//! A reported topology is a list per level of CPU groups, each group its
//! own vector: about 2.2 KB of heap for a 64-CPU node, the same for every
//! machine of a model, and fleets are mostly a few models. [`Shapes`]
//! keys them by their encoding; a shape no node holds any more is
//! dropped when a new one is added, so an agent re-registering with
//! ever-new topologies cannot grow the table past one shape per node
//! plus one. [`CpuShape`] is the same per engine tree (kept by
//! `Nodes::cpu_tree` with the same rule): the tree and each CPU's group
//! per alignment level, so that a node's CPU model is one bit per CPU and
//! one idle count per group ([`IdleCounts`], [`CpuShape::summary`]), not
//! a group index per CPU and level (1.3 KB on 64 CPUs). Label strings ([`Strings`]) and device
//! lists ([`Devices`]) can be distinct per node (a host-name label,
//! PCI addresses): their tables are swept when they have doubled since
//! the last sweep, which bounds them at twice what nodes hold (plus a
//! constant) for O(1) amortized work per registration.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use proto::v1::{Device, Topology};
use sched::alloc::align_groups;
use sched::{Align, FreeSummary, LeafId};

/// The distinct reported topologies, by encoding.
#[derive(Debug, Default)]
pub struct Shapes {
    by_encoding: HashMap<Box<[u8]>, Arc<Topology>>,
}

impl Shapes {
    /// The shared copy of `topology`.
    pub fn intern(&mut self, topology: Topology) -> Arc<Topology> {
        let key = prost::Message::encode_to_vec(&topology).into_boxed_slice();
        if let Some(t) = self.by_encoding.get(&key) {
            return t.clone();
        }
        self.by_encoding.retain(|_, t| Arc::strong_count(t) > 1);
        let t = Arc::new(topology);
        self.by_encoding.insert(key, t.clone());
        t
    }

    /// Distinct shapes held.
    pub fn len(&self) -> usize {
        self.by_encoding.len()
    }

    /// True when no shape is held.
    pub fn is_empty(&self) -> bool {
        self.by_encoding.is_empty()
    }
}

/// A machine shape as the dispatcher's CPU model counts it, shared by the
/// nodes of that shape: the engine tree over its CPUs, each CPU's group
/// per alignment level (as an index into a node's [`IdleCounts`]), and
/// the free room of the whole (idle) machine. A node keeps its busy
/// bitmap and its idle CPUs per group, nothing per CPU and level.
#[derive(Debug)]
pub struct CpuShape {
    tree: Arc<sched::Topology>,
    /// Per CPU: its group's counter at each level ([`Align::ALL`] order),
    /// numbered across levels (level `i`'s counters end at `ends[i]`;
    /// groups in `align_groups` order).
    group_of: Box<[[u32; 5]]>,
    ends: [u32; 5],
    /// The counts of the machine with every CPU idle (each group's size).
    idle: IdleCounts,
    /// The free room of the machine with every CPU idle.
    whole: FreeSummary,
}

impl CpuShape {
    /// The shape of the engine tree `tree`.
    pub fn new(tree: sched::Topology) -> Self {
        let mut group_of = vec![[0u32; 5]; tree.nr_leaves()];
        let mut sizes: Vec<u32> = Vec::new();
        let mut ends = [0u32; 5];
        for align in Align::ALL {
            let i = align.index();
            for group in align_groups(&tree, align) {
                for &l in group {
                    group_of[l][i] = sizes.len() as u32;
                }
                sizes.push(group.len() as u32);
            }
            ends[i] = sizes.len() as u32;
        }
        let idle = if tree.nr_leaves() <= usize::from(u16::MAX) {
            IdleCounts::Small(sizes.iter().map(|&n| n as u16).collect())
        } else {
            IdleCounts::Large(sizes.into_boxed_slice())
        };
        let mut shape = Self {
            tree: Arc::new(tree),
            group_of: group_of.into_boxed_slice(),
            ends,
            idle,
            whole: FreeSummary::default(),
        };
        shape.whole = shape.summary(&shape.idle);
        shape
    }

    /// The engine tree.
    pub fn tree(&self) -> &Arc<sched::Topology> {
        &self.tree
    }

    /// Its CPUs (the tree's leaves).
    pub fn nr_cpus(&self) -> usize {
        self.group_of.len()
    }

    /// A busy bitmap with every CPU idle.
    pub fn idle_bits(&self) -> Box<[u64]> {
        vec![0; self.tree.nr_leaves().div_ceil(64)].into_boxed_slice()
    }

    /// The idle counts with every CPU idle.
    pub fn idle_counts(&self) -> IdleCounts {
        self.idle.clone()
    }

    /// The free room of the machine with every CPU idle.
    pub fn whole(&self) -> FreeSummary {
        self.whole
    }

    /// CPU `cpu` of a node with counts `idle` became idle (`delta` 1) or
    /// busy (-1). Inline: called per CPU of every claim and release.
    #[inline]
    pub fn add(&self, idle: &mut IdleCounts, cpu: LeafId, delta: i32) {
        let Some(groups) = self.group_of.get(cpu) else {
            return;
        };
        match idle {
            IdleCounts::Small(c) => {
                // A count stays within its group's size (at most 65,535).
                for &g in groups {
                    if let Some(n) = c.get_mut(g as usize) {
                        *n = n.wrapping_add_signed(delta as i16);
                    }
                }
            }
            IdleCounts::Large(c) => {
                for &g in groups {
                    if let Some(n) = c.get_mut(g as usize) {
                        *n = n.saturating_add_signed(delta);
                    }
                }
            }
        }
    }

    /// The free room per level of a node with counts `idle` (as
    /// `free_summary_of` over its busy CPUs): per level, the most idle
    /// CPUs in one group.
    pub fn summary(&self, idle: &IdleCounts) -> FreeSummary {
        // A fold over copies from 0 (the counts are unsigned, so an empty
        // group gives 0 as `max` of none did): it vectorises, where
        // `iter().max()` over references cost ~290 instructions per call
        // on a 32-CPU node, twice per job (claim and release).
        fn most<T: Copy + Ord + Default + Into<u32>>(c: &[T], ends: &[u32; 5]) -> [u32; 5] {
            let mut out = [0u32; 5];
            let mut start = 0usize;
            for (m, &end) in out.iter_mut().zip(ends) {
                let end = end as usize;
                *m = c
                    .get(start..end)
                    .map_or(0, |c| c.iter().copied().fold(T::default(), Ord::max).into());
                start = end;
            }
            out
        }
        let [core, llc, numa, package, any] = match idle {
            IdleCounts::Small(c) => most(c, &self.ends),
            IdleCounts::Large(c) => most(c, &self.ends),
        };
        FreeSummary {
            core,
            llc,
            numa,
            package,
            any,
        }
    }
}

/// A node's idle CPUs per alignment group (its free summary kept by
/// difference), numbered as its [`CpuShape`] numbers the groups: 2 bytes
/// a group on machines of up to 65,535 CPUs, else 4.
#[derive(Clone, Debug)]
pub enum IdleCounts {
    /// Up to 65,535 CPUs.
    Small(Box<[u16]>),
    /// More.
    Large(Box<[u32]>),
}

/// Interned strings (label keys and values), each held once by `Arc`.
#[derive(Debug, Default)]
pub struct Strings {
    set: HashSet<Arc<str>>,
    /// Strings held after the last sweep.
    swept: usize,
}

impl Strings {
    /// The shared copy of `s`.
    pub fn intern(&mut self, s: &str) -> Arc<str> {
        if let Some(x) = self.set.get(s) {
            return x.clone();
        }
        if self.set.len() >= 2 * self.swept + 1024 {
            self.set.retain(|x| Arc::strong_count(x) > 1);
            self.swept = self.set.len();
        }
        let x: Arc<str> = Arc::from(s);
        self.set.insert(x.clone());
        x
    }

    /// Strings held.
    pub fn len(&self) -> usize {
        self.set.len()
    }

    /// True when none is held.
    pub fn is_empty(&self) -> bool {
        self.set.is_empty()
    }
}

/// A node's labels: its (key, value) pairs sorted by key, the strings
/// interned ([`Strings`]); the list shared by copies of the node (the API
/// views' `listing.rs`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Labels(Option<Arc<[LabelPair]>>);

/// A label's key and value, interned.
type LabelPair = (Arc<str>, Arc<str>);

impl Labels {
    /// The labels of `map`, their strings from `strings`.
    pub fn new(map: &HashMap<String, String>, strings: &mut Strings) -> Self {
        if map.is_empty() {
            return Self(None);
        }
        let mut pairs: Vec<LabelPair> = map
            .iter()
            .map(|(k, v)| (strings.intern(k), strings.intern(v)))
            .collect();
        pairs.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        Self(Some(pairs.into()))
    }

    fn pairs(&self) -> &[LabelPair] {
        self.0.as_deref().unwrap_or_default()
    }

    /// The value of `key`.
    pub fn get(&self, key: &str) -> Option<&str> {
        let pairs = self.pairs();
        pairs
            .binary_search_by(|(k, _)| (**k).cmp(key))
            .ok()
            .map(|i| &*pairs[i].1)
    }

    /// True when `key` is `value`.
    pub fn has(&self, key: &str, value: &str) -> bool {
        self.get(key) == Some(value)
    }

    /// The pairs, by key.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.pairs().iter().map(|(k, v)| (&**k, &**v))
    }

    /// Number of labels.
    pub fn len(&self) -> usize {
        self.pairs().len()
    }

    /// True without labels.
    pub fn is_empty(&self) -> bool {
        self.pairs().is_empty()
    }

    /// The labels as the API shows them.
    pub fn to_map(&self) -> HashMap<String, String> {
        self.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }
}

/// The distinct device lists nodes reported, by encoding.
#[derive(Debug, Default)]
pub struct Devices {
    by_encoding: HashMap<Box<[u8]>, Arc<[Device]>>,
    /// Lists held after the last sweep.
    swept: usize,
}

impl Devices {
    /// The shared copy of `devices`.
    pub fn intern(&mut self, devices: &[Device]) -> Arc<[Device]> {
        let mut key = Vec::new();
        for d in devices {
            key.extend(prost::Message::encode_length_delimited_to_vec(d));
        }
        if let Some(d) = self.by_encoding.get(key.as_slice()) {
            return d.clone();
        }
        if self.by_encoding.len() >= 2 * self.swept + 64 {
            self.by_encoding.retain(|_, d| Arc::strong_count(d) > 1);
            self.swept = self.by_encoding.len();
        }
        let d: Arc<[Device]> = devices.into();
        self.by_encoding.insert(key.into_boxed_slice(), d.clone());
        d
    }

    /// Distinct lists held.
    pub fn len(&self) -> usize {
        self.by_encoding.len()
    }

    /// True when none is held.
    pub fn is_empty(&self) -> bool {
        self.by_encoding.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::tests::{machine, register_node};
    use crate::cluster::{Cluster, ClusterConfig, Effects};
    use proptest::prelude::*;

    proptest! {
        /// Interning never changes a topology, and equal topologies share
        /// one copy: checked against the plain values.
        #[test]
        fn shapes_are_shared_by_equal_topologies(picks in proptest::collection::vec(0usize..4, 1..30)) {
            let specs = ["2s:4c:2t", "1s:8c:2t", "1s:2c:1t", "2s:2c:1t"];
            let mut shapes = Shapes::default();
            let mut held: Vec<(usize, Arc<Topology>)> = Vec::new();
            for p in picks {
                let t = shapes.intern(machine(specs[p]));
                prop_assert_eq!(&*t, &machine(specs[p]));
                for (q, other) in &held {
                    prop_assert_eq!(Arc::ptr_eq(&t, other), *q == p);
                }
                held.push((p, t));
            }
            let distinct: std::collections::HashSet<usize> = held.iter().map(|(p, _)| *p).collect();
            prop_assert_eq!(shapes.len(), distinct.len());
        }
    }

    /// Nodes of one model share their reported topology; their views
    /// (ListNodes' `Node`) are what they reported.
    #[test]
    fn registered_nodes_share_their_shape_and_show_it_whole() {
        let mut c = Cluster::new(ClusterConfig::default());
        let mut fx = Effects::default();
        register_node(&mut c, "a", "2s:4c:2t", ("z", "r1"), 0, &mut fx);
        register_node(&mut c, "b", "2s:4c:2t", ("z", "r2"), 0, &mut fx);
        register_node(&mut c, "c", "1s:2c:1t", ("z", "r2"), 0, &mut fx);
        let t = |n: &str| c.nodes.get(n).unwrap().topology.clone();
        assert!(Arc::ptr_eq(&t("a"), &t("b")));
        assert!(!Arc::ptr_eq(&t("a"), &t("c")));
        for (n, spec) in [("a", "2s:4c:2t"), ("b", "2s:4c:2t"), ("c", "1s:2c:1t")] {
            let view = c.node_proto(c.nodes.get(n).unwrap());
            assert_eq!(view.topology, Some(machine(spec)));
        }
    }

    /// A node re-registering with a new topology every time leaves one
    /// shape per node plus one.
    #[test]
    fn shapes_no_node_holds_are_dropped() {
        let mut c = Cluster::new(ClusterConfig::default());
        let mut fx = Effects::default();
        register_node(&mut c, "a", "2s:4c:2t", ("z", "r1"), 0, &mut fx);
        let mut most = 0;
        for cores in 1..=40 {
            register_node(
                &mut c,
                "evil",
                &format!("1s:{cores}c:1t"),
                ("z", "r3"),
                cores,
                &mut fx,
            );
            most = most.max(c.nodes.shapes.len());
        }
        assert!(most <= 3, "{most} shapes for 2 nodes");
        assert_eq!(*c.nodes.get("a").unwrap().topology, machine("2s:4c:2t"));
    }
}
