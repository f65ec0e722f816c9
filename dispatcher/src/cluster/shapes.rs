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
//! `Nodes::cpu_tree` with the same rule): the tree and each alignment
//! group's CPUs as bit masks, so that a node's CPU model is one bit per
//! CPU and its free room per level is counted from those bits
//! ([`CpuShape::summary`]). Label strings ([`Strings`]) and device
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
/// nodes of that shape: the engine tree over its CPUs, each alignment
/// group's CPUs as (word, mask) pairs over a CPU bitmap, and the free room
/// of the whole (idle) machine. A node's model is then its busy bitmap
/// alone (one bit per CPU).
#[derive(Debug)]
pub struct CpuShape {
    tree: Arc<sched::Topology>,
    /// Per level ([`Align::ALL`] order): the end of each group's pairs in
    /// `words` (groups in `align_groups` order).
    ends: [Box<[u32]>; 5],
    /// Per level: the groups' (word index, mask) pairs, group after group.
    words: [Box<[(u32, u64)]>; 5],
    /// The free room of the machine with every CPU idle.
    whole: FreeSummary,
}

impl CpuShape {
    /// The shape of the engine tree `tree`.
    pub fn new(tree: sched::Topology) -> Self {
        let mut ends: [Vec<u32>; 5] = Default::default();
        let mut words: [Vec<(u32, u64)>; 5] = Default::default();
        for align in Align::ALL {
            let i = align.index();
            for group in align_groups(&tree, align) {
                let mut pairs: Vec<(u32, u64)> = Vec::new();
                let mut cpus: Vec<LeafId> = group.to_vec();
                cpus.sort_unstable();
                for l in cpus {
                    let (w, bit) = ((l / 64) as u32, 1u64 << (l % 64));
                    match pairs.last_mut() {
                        Some((lw, m)) if *lw == w => *m |= bit,
                        _ => pairs.push((w, bit)),
                    }
                }
                words[i].extend(pairs);
                ends[i].push(words[i].len() as u32);
            }
        }
        let mut shape = Self {
            tree: Arc::new(tree),
            ends: ends.map(Vec::into_boxed_slice),
            words: words.map(Vec::into_boxed_slice),
            whole: FreeSummary::default(),
        };
        shape.whole = shape.summary(&shape.idle_bits());
        shape
    }

    /// The engine tree.
    pub fn tree(&self) -> &Arc<sched::Topology> {
        &self.tree
    }

    /// A busy bitmap with every CPU idle.
    pub fn idle_bits(&self) -> Box<[u64]> {
        vec![0; self.tree.nr_leaves().div_ceil(64)].into_boxed_slice()
    }

    /// The free room of the machine with every CPU idle.
    pub fn whole(&self) -> FreeSummary {
        self.whole
    }

    /// The free room per level of a machine of this shape whose busy CPUs
    /// are the set bits of `busy` (as `free_summary_of` over them): per
    /// level, the most idle CPUs in one group.
    pub fn summary(&self, busy: &[u64]) -> FreeSummary {
        let most = |align: Align| {
            let i = align.index();
            let words = &self.words[i];
            let mut start = 0usize;
            let mut best = 0u32;
            for &end in self.ends[i].iter() {
                let end = end as usize;
                let idle: u32 = words[start..end]
                    .iter()
                    .map(|&(w, m)| (m & !busy.get(w as usize).copied().unwrap_or(0)).count_ones())
                    .sum();
                best = best.max(idle);
                start = end;
            }
            best
        };
        FreeSummary {
            core: most(Align::Core),
            llc: most(Align::Llc),
            numa: most(Align::Numa),
            package: most(Align::Package),
            any: most(Align::Any),
        }
    }
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
pub struct Labels(Option<Arc<[(Arc<str>, Arc<str>)]>>);

impl Labels {
    /// The labels of `map`, their strings from `strings`.
    pub fn new(map: &HashMap<String, String>, strings: &mut Strings) -> Self {
        if map.is_empty() {
            return Self(None);
        }
        let mut pairs: Vec<(Arc<str>, Arc<str>)> = map
            .iter()
            .map(|(k, v)| (strings.intern(k), strings.intern(v)))
            .collect();
        pairs.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        Self(Some(pairs.into()))
    }

    fn pairs(&self) -> &[(Arc<str>, Arc<str>)] {
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
