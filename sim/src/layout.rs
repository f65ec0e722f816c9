//! The simulated cluster: zones of racks of nodes (a `sched` cluster spec
//! such as `10z:10r:100n`, optional host groups `:4h`), and each node's CPU
//! topology (a machine spec such as `2s:16c:2t`, or a weighted mix
//! `2s:16c:2t*3,1s:8c:2t`). Nodes are numbered zone by zone, rack by rack;
//! their names sort in that order (`n000042`), so the dispatcher's node
//! tree has the same leaf order.

use std::collections::HashMap;
use std::sync::Arc;

use proto::v1::Register;
use sched::Topology;
use sched::topology::TopoSpec;

use crate::error::{Result, bad_spec};

/// Label keys the dispatcher reads by default.
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";
/// Rack label.
pub const RACK_LABEL: &str = "dispatch.io/rack";
/// Host-group label.
pub const HOSTGROUP_LABEL: &str = "dispatch.io/hostgroup";

/// One kind of node.
#[derive(Clone, Debug)]
pub struct NodeShape {
    /// Its machine spec.
    pub spec: String,
    /// The engine tree over its CPUs.
    pub topo: Arc<Topology>,
    /// As agents report it.
    pub proto: proto::v1::Topology,
    /// CPUs.
    pub cpus: u32,
}

impl NodeShape {
    /// Build from a machine spec.
    pub fn new(spec: &str) -> Result<Self> {
        let t = Topology::from_spec(spec)?;
        if matches!(TopoSpec::parse(spec)?, TopoSpec::Cluster { .. }) {
            return Err(bad_spec(
                "node topology",
                spec,
                "a node is a machine (<S>s:<C>c:<T>t), not a cluster",
            ));
        }
        let proto = engine_proto::topology(&t);
        Ok(Self {
            spec: spec.to_string(),
            cpus: t.nr_leaves() as u32,
            topo: Arc::new(t),
            proto,
        })
    }
}

/// The cluster.
#[derive(Clone, Debug)]
pub struct Layout {
    /// The cluster spec.
    pub spec: String,
    /// Zones.
    pub zones: usize,
    /// Racks per zone.
    pub racks_per_zone: usize,
    /// Nodes per rack.
    pub nodes_per_rack: usize,
    /// Nodes per host group, if the level exists.
    pub hostgroup: Option<usize>,
    /// Kinds of nodes.
    pub shapes: Vec<NodeShape>,
    /// Shape of each node.
    node_shape: Vec<u16>,
    capacity: u64,
    /// GPUs of each node (empty: no node has any).
    gpus: Vec<u32>,
}

impl Layout {
    /// Build from a cluster spec (`Z z:R r:N n[:H h]`) and node shapes
    /// (`SPEC[*WEIGHT],...`; nodes take shapes in a repeating pattern of
    /// the weights).
    pub fn new(cluster: &str, nodes: &str) -> Result<Self> {
        let (zones, racks, per_rack, hostgroup) = match TopoSpec::parse(cluster)? {
            TopoSpec::Cluster {
                zones,
                racks,
                nodes,
                hostgroup,
            } => (zones, racks, nodes, hostgroup),
            TopoSpec::Machine { .. } => {
                return Err(bad_spec(
                    "cluster",
                    cluster,
                    "want <Z>z:<R>r:<N>n (zones, racks per zone, nodes per rack)",
                ));
            }
        };
        let total = zones * racks * per_rack;
        if total > 1_000_000 {
            return Err(bad_spec("cluster", cluster, "more than 1,000,000 nodes"));
        }
        let mut shapes = Vec::new();
        let mut pattern: Vec<u16> = Vec::new();
        for part in nodes.split(',') {
            let (spec, weight) = match part.split_once('*') {
                Some((s, w)) => (
                    s.trim(),
                    w.trim()
                        .parse::<usize>()
                        .ok()
                        .filter(|&w| (1..=1000).contains(&w))
                        .ok_or_else(|| {
                            bad_spec("node topology", nodes, "weights are integers 1..=1000")
                        })?,
                ),
                None => (part.trim(), 1),
            };
            if shapes.len() >= u16::MAX as usize {
                return Err(bad_spec("node topology", nodes, "too many shapes"));
            }
            let idx = shapes.len() as u16;
            shapes.push(NodeShape::new(spec)?);
            pattern.extend(std::iter::repeat_n(idx, weight));
        }
        let node_shape: Vec<u16> = (0..total).map(|i| pattern[i % pattern.len()]).collect();
        let capacity = node_shape
            .iter()
            .map(|&s| shapes[s as usize].cpus as u64)
            .sum();
        Ok(Self {
            spec: cluster.to_string(),
            zones,
            racks_per_zone: racks,
            nodes_per_rack: per_rack,
            hostgroup,
            shapes,
            node_shape,
            capacity,
            gpus: Vec::new(),
        })
    }

    /// A cluster of one zone of racks of `per_rack` nodes (the node count
    /// must be a multiple of it) whose node `i` has the machine spec
    /// `nodes[i].0` and `nodes[i].1` GPUs (a trace's own node list).
    pub fn with_nodes(nodes: &[(String, u32)], per_rack: usize) -> Result<Self> {
        let per_rack = per_rack.max(1);
        if nodes.is_empty() || !nodes.len().is_multiple_of(per_rack) {
            return Err(bad_spec(
                "node list",
                &format!("{} nodes", nodes.len()),
                format!("want a positive multiple of {per_rack} nodes"),
            ));
        }
        let mut shapes: Vec<NodeShape> = Vec::new();
        let mut node_shape = Vec::with_capacity(nodes.len());
        for (spec, _) in nodes {
            let idx = match shapes.iter().position(|s| &s.spec == spec) {
                Some(i) => i,
                None => {
                    if shapes.len() >= u16::MAX as usize {
                        return Err(bad_spec("node list", spec, "too many shapes"));
                    }
                    shapes.push(NodeShape::new(spec)?);
                    shapes.len() - 1
                }
            };
            node_shape.push(idx as u16);
        }
        let capacity = node_shape
            .iter()
            .map(|&s| shapes[s as usize].cpus as u64)
            .sum();
        let racks = nodes.len() / per_rack;
        Ok(Self {
            spec: format!("1z:{racks}r:{per_rack}n"),
            zones: 1,
            racks_per_zone: racks,
            nodes_per_rack: per_rack,
            hostgroup: None,
            shapes,
            node_shape,
            capacity,
            gpus: nodes.iter().map(|n| n.1).collect(),
        })
    }

    /// GPUs of a node.
    pub fn gpus(&self, node: u32) -> u32 {
        self.gpus.get(node as usize).copied().unwrap_or(0)
    }

    /// GPUs of the cluster.
    pub fn total_gpus(&self) -> u64 {
        self.gpus.iter().map(|&g| g as u64).sum()
    }

    /// Number of nodes.
    pub fn nr_nodes(&self) -> usize {
        self.node_shape.len()
    }

    /// Total CPUs.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// CPUs of a node.
    pub fn cpus(&self, node: u32) -> u32 {
        self.shape(node).cpus
    }

    /// The shape of a node.
    pub fn shape(&self, node: u32) -> &NodeShape {
        &self.shapes[self.node_shape[node as usize] as usize]
    }

    /// The largest node's CPUs.
    pub fn max_node_cpus(&self) -> u32 {
        self.shapes.iter().map(|s| s.cpus).max().unwrap_or(0)
    }

    /// The smallest node's CPUs.
    pub fn min_node_cpus(&self) -> u32 {
        self.shapes.iter().map(|s| s.cpus).min().unwrap_or(0)
    }

    /// Global rack index of a node.
    pub fn rack_of(&self, node: u32) -> u32 {
        node / self.nodes_per_rack as u32
    }

    /// Zone of a node.
    pub fn zone_of(&self, node: u32) -> u32 {
        node / (self.nodes_per_rack * self.racks_per_zone) as u32
    }

    /// A node's name (sorts in node order).
    pub fn node_name(node: u32) -> String {
        format!("n{node:06}")
    }

    /// The node index of a name made by [`Layout::node_name`].
    pub fn node_index(name: &str) -> Option<u32> {
        name.strip_prefix('n')?.parse().ok()
    }

    /// The registration an agent on this node would send.
    pub fn register(&self, node: u32) -> Register {
        let zone = self.zone_of(node);
        let rack = self.rack_of(node);
        let mut labels = HashMap::new();
        labels.insert(ZONE_LABEL.to_string(), format!("z{zone:04}"));
        labels.insert(RACK_LABEL.to_string(), format!("r{rack:06}"));
        if let Some(h) = self.hostgroup {
            labels.insert(
                HOSTGROUP_LABEL.to_string(),
                format!("h{:07}", node as usize / h.max(1)),
            );
        }
        // Its GPUs, on the machine's first NUMA node (the node shapes of
        // GPU traces are one socket).
        let devices = (0..self.gpus(node))
            .map(|i| proto::v1::Device {
                kind: proto::v1::DeviceKind::Gpu as i32,
                index: i,
                numa_node: Some(0),
                ..Default::default()
            })
            .collect();
        Register {
            node: Self::node_name(node),
            labels,
            topology: Some(self.shape(node).proto.clone()),
            devices,
            ..Default::default()
        }
    }

    /// A short description: `10z:10r:100n x 2s:16c:2t (640000 CPUs)`.
    pub fn describe(&self) -> String {
        let shapes: Vec<&str> = self.shapes.iter().map(|s| s.spec.as_str()).collect();
        format!(
            "{} nodes ({}) x {} = {} CPUs",
            self.nr_nodes(),
            self.spec,
            shapes.join(","),
            self.capacity
        )
    }
}

/// A single-zone cluster spec of `procs` processors (rounded up to whole
/// nodes) in nodes of `node_cpus`, in racks of at most 8 nodes: the fewest
/// equal racks that hold exactly that many nodes when there are such, else
/// rounded up. For trace replays on a machine of the traced size.
pub fn cluster_for(procs: u32, node_cpus: u32) -> String {
    let nodes = procs.div_ceil(node_cpus.max(1)).max(1) as usize;
    let least = nodes.div_ceil(8);
    let racks = (least..=nodes)
        .find(|&r| nodes.is_multiple_of(r) && nodes / r <= 8)
        .unwrap_or(least);
    let per_rack = nodes.div_ceil(racks);
    format!("1z:{racks}r:{per_rack}n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_numbers_zone_by_zone() {
        let l = Layout::new("2z:3r:4n", "1s:2c:2t*3,1s:4c:2t").unwrap();
        assert_eq!(l.nr_nodes(), 24);
        assert_eq!(l.zone_of(11), 0);
        assert_eq!(l.zone_of(12), 1);
        assert_eq!(l.rack_of(5), 1);
        assert_eq!(l.cpus(0), 4);
        assert_eq!(l.cpus(3), 8);
        assert_eq!(l.capacity(), 6 * (4 * 3 + 8));
        assert_eq!(Layout::node_index(&Layout::node_name(42)), Some(42));
        let r = l.register(13);
        assert_eq!(r.labels[RACK_LABEL], "r000003");
        assert!(Layout::new("2s:4c:1t", "1s:1c:1t").is_err());
        assert!(Layout::new("1z:1r:1n", "1z:1r:1n").is_err());
        assert!(Layout::new("1z:1r:1n", "1s:1c:1t*0").is_err());
    }

    #[test]
    fn trace_clusters_hold_the_machine() {
        assert_eq!(cluster_for(100, 4), "1z:5r:5n");
        assert_eq!(cluster_for(7 * 4, 4), "1z:1r:7n");
        assert_eq!(cluster_for(128, 4), "1z:4r:8n");
    }
}
