//! Reported topologies shared per distinct shape: nodes whose agents
//! report the same topology hold one `Arc` of it, as they already share
//! one engine tree (`Nodes::cpu_tree`).
//!
//! A reported topology is a list per level of CPU groups, each group its
//! own vector: about 2.2 KB of heap for a 64-CPU node, the same for every
//! machine of a model, and fleets are mostly a few models. [`Shapes`]
//! keys them by their encoding; a shape no node holds any more is
//! dropped when a new one is added, so an agent re-registering with
//! ever-new topologies cannot grow the table past one shape per node
//! plus one.

use std::collections::HashMap;
use std::sync::Arc;

use proto::v1::Topology;

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
