//! Nodes' API views (`proto::v1::Node`) in two steps, so that ListNodes
//! costs the core thread a copy, not the views: [`Cluster::node_copies`]
//! copies on the core what a view needs (the names; the labels, topology
//! and packed load shared; the free GPUs and gangs only the cluster
//! knows), and [`NodeCopy::into_view`] does the slow part anywhere else
//! (a copy of the topology and the unpacked load report per node; at
//! 10,000 nodes tens of milliseconds, which the core used to spend in
//! slices between its batches and which showed in every submission's
//! latency). GetNode uses the same two steps on the core: one view is
//! the same whichever thread builds it.

use std::sync::Arc;

use proto::v1::{Device, Node, NodeState, Topology};

use super::jobs::JobKey;
use super::load::PackedLoad;
use super::shapes::Labels;
use super::{Cluster, NodeInfo};

/// What a node's API view needs, copied out of the cluster: the topology
/// and the load are shared, not copied.
#[derive(Clone, Debug)]
pub struct NodeCopy {
    name: String,
    labels: Labels,
    zone: String,
    rack: String,
    topology: Arc<Topology>,
    load: PackedLoad,
    state: NodeState,
    last_heartbeat_ms: i64,
    devices: Arc<[Device]>,
    gpus: u32,
    gpus_free: u32,
    gangs: Vec<String>,
}

impl NodeCopy {
    /// The node's API view.
    pub fn into_view(self) -> Node {
        let topo = &self.topology;
        let cores = topo.smt.len() as u32;
        Node {
            sockets: topo.package.len() as u32,
            numa_nodes: topo.numa.len() as u32,
            llcs: topo.llc.len() as u32,
            cores,
            threads_per_core: (topo.cpus.len() as u32).checked_div(cores).unwrap_or(0),
            topology: Some(Topology::clone(topo)),
            load: Some(self.load.to_proto()),
            name: self.name,
            labels: self.labels.to_map(),
            state: self.state as i32,
            last_heartbeat_ms: self.last_heartbeat_ms,
            zone: self.zone,
            rack: self.rack,
            devices: self.devices.to_vec(),
            gpus: self.gpus,
            gpus_free: self.gpus_free,
            gangs: self.gangs,
        }
    }
}

/// The views of `copies` (shared by the listings of one batch: the last
/// one to build takes the copies instead of cloning them).
pub fn views(copies: Arc<Vec<NodeCopy>>) -> Vec<Node> {
    match Arc::try_unwrap(copies) {
        Ok(copies) => copies.into_iter().map(NodeCopy::into_view).collect(),
        Err(shared) => shared.iter().cloned().map(NodeCopy::into_view).collect(),
    }
}

impl Cluster {
    /// What `n`'s API view needs, with the GPUs no job holds and the gangs
    /// that hold it.
    pub fn node_copy(&self, n: &NodeInfo) -> NodeCopy {
        NodeCopy {
            name: n.name.to_string(),
            labels: n.labels.clone(),
            zone: n.zone().to_string(),
            rack: n.rack().to_string(),
            topology: Arc::clone(&n.topology),
            load: n.load.clone(),
            state: n.state(),
            last_heartbeat_ms: n.last_heartbeat_ms,
            devices: Arc::clone(&n.devices),
            gpus: n.gpus,
            gpus_free: self.gpus_free(&n.name),
            gangs: self
                .gangs_on(&n.name)
                .into_iter()
                .map(|g| JobKey::single(g).to_string())
                .collect(),
        }
    }

    /// Every node's copy, in name order (ListNodes).
    pub fn node_copies(&self) -> Vec<NodeCopy> {
        self.nodes().map(|n| self.node_copy(n)).collect()
    }

    /// One page of ListNodes: the copies of at most `size` nodes named
    /// after `after` (from the first node when it is empty), in name
    /// order, and the token of the next page: the last node's name when
    /// nodes remain after it, else empty. `size` 0 is every node.
    pub fn node_copies_page(&self, after: &str, size: usize) -> (Vec<NodeCopy>, String) {
        let mut nodes = self.nodes.iter_after(after);
        let size = if size == 0 { usize::MAX } else { size };
        let page: Vec<NodeCopy> = nodes
            .by_ref()
            .take(size)
            .map(|n| self.node_copy(n))
            .collect();
        let next = match (page.last(), nodes.next()) {
            (Some(last), Some(_)) => last.name.clone(),
            _ => String::new(),
        };
        (page, next)
    }

    /// `n`'s API view, built here.
    pub fn node_proto(&self, n: &NodeInfo) -> Node {
        self.node_copy(n).into_view()
    }
}

#[cfg(test)]
mod tests {
    use proto::v1::{JobSpec, NodeLoad};

    use super::*;
    use crate::cluster::tests::register_node;
    use crate::cluster::{ClusterConfig, Effects};

    /// The view built from a copy is the node as the cluster holds it
    /// (every field read straight from the registry), in name order, and
    /// views of shared copies equal views of owned ones.
    #[test]
    fn a_copy_builds_the_nodes_view() {
        let mut c = Cluster::new(ClusterConfig::default());
        let mut fx = Effects::default();
        register_node(&mut c, "b", "2s:4c:2t", ("z1", "r1"), 0, &mut fx);
        register_node(&mut c, "a", "1s:2c:1t", ("z1", "r2"), 0, &mut fx);
        register_node(&mut c, "c", "1s:8c:2t", ("z2", "r3"), 0, &mut fx);
        let job = JobSpec {
            command: vec!["true".into()],
            cpus: 2,
            ..Default::default()
        };
        c.submit(vec![job], false, 1, &mut fx).unwrap();
        let load = NodeLoad {
            running_jobs: 1,
            cpus: vec![Default::default(); 2],
            ..Default::default()
        };
        c.load_report("c", &load, 2, &mut fx);
        c.settle(2, &mut fx);
        let copies = Arc::new(c.node_copies());
        let shared = views(Arc::clone(&copies));
        let owned = views(copies);
        assert_eq!(shared, owned);
        let names: Vec<&str> = owned.iter().map(|v| v.name.as_str()).collect();
        assert_eq!(names, ["a", "b", "c"]);
        for view in owned {
            let n = c.node(&view.name).unwrap();
            let topo = &n.topology;
            assert_eq!(view.labels, n.labels.to_map());
            assert_eq!(view.topology.as_ref(), Some(topo.as_ref()));
            assert_eq!(view.load, Some(n.load.to_proto()));
            assert_eq!(view.state, n.state() as i32);
            assert_eq!(view.last_heartbeat_ms, n.last_heartbeat_ms);
            assert_eq!(view.sockets as usize, topo.package.len());
            assert_eq!(view.numa_nodes as usize, topo.numa.len());
            assert_eq!(view.llcs as usize, topo.llc.len());
            assert_eq!(view.cores as usize, topo.smt.len());
            assert_eq!(
                view.threads_per_core as usize,
                topo.cpus.len() / topo.smt.len()
            );
            assert_eq!(
                (view.zone.as_str(), view.rack.as_str()),
                (n.zone(), n.rack())
            );
            assert_eq!((view.gpus, view.gpus_free), (n.gpus, c.gpus_free(&n.name)));
            assert_eq!(view, c.node_proto(n));
        }
        let c_view = c.node_proto(c.node("c").unwrap());
        assert_eq!(c_view.load.map(|l| l.running_jobs), Some(1));
    }
}
