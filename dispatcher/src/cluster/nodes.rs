//! The node registry: each node's labels and place in the cluster (region,
//! zone, rack, host group), its reported topology and the engine tree over
//! its CPUs, the dispatcher's model of which of those CPUs its jobs hold,
//! its heartbeats and its administrative state, and its devices (GPUs:
//! how many; which are taken is the job table's `gpus_on`).
//!
//! Invariant: a node's CPU model marks exactly the CPUs of the jobs the
//! dispatcher has on it (`JobEntry::model_cpus`); nodes share one engine
//! tree per distinct reported topology, and the cache of those trees
//! holds only trees some node uses (plus the one being registered): an
//! agent that re-registers with ever-new topologies cannot grow it.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use proto::v1::{JobSpec, NodeState};
use sched::alloc::{align_groups, find_aligned_in, free_summary_of};
use sched::idhash::IdMap;
use sched::{Align, FreeSummary, LeafId, Topology};
use tonic::Status;

use super::load::PackedLoad;
use super::shapes::Shapes;
use crate::spec::{align_of, policy_of};
use crate::store::NodeAdmin;

/// A node as the dispatcher knows it.
#[derive(Clone, Debug)]
pub struct NodeInfo {
    /// Unique name.
    pub name: String,
    /// Labels (shared with the API views' copies: `listing.rs`).
    pub labels: Arc<HashMap<String, String>>,
    /// Zone, rack, host group and region derived from labels.
    pub zone: String,
    /// Rack.
    pub rack: String,
    /// Host group ("" when unlabelled: the node is its own group).
    pub hostgroup: String,
    /// Region.
    pub region: String,
    /// The topology as reported (shared by nodes that report the same
    /// one: [`Shapes`]).
    pub topology: Arc<proto::v1::Topology>,
    /// The same, as an engine tree over CPU numbers (for alignment).
    pub cpu_topo: Arc<Topology>,
    /// The dispatcher's model of which CPUs its jobs hold (by dense CPU).
    /// Changed only by [`NodeInfo::claim`] and [`NodeInfo::release`],
    /// which keep `idle` in step.
    pub cpu_busy: Vec<bool>,
    /// The model's idle CPUs counted per alignment group (its free summary
    /// kept by difference).
    pub(crate) idle: IdleCounts,
    /// Memory offered to jobs.
    pub memory_bytes: u64,
    /// The PCI devices its agent reported (GPUs, accelerators, NICs).
    pub devices: Vec<proto::v1::Device>,
    /// Its GPUs (devices of kind GPU).
    pub gpus: u32,
    /// Runnable jobs per CPU the agent accepts (1 = no oversubscription).
    pub oversubscribe: u32,
    /// The last load report, packed ([`PackedLoad`]).
    pub load: PackedLoad,
    /// Administrative state.
    pub admin: NodeAdmin,
    /// The agent's stream is open.
    pub connected: bool,
    /// Marked down after missed heartbeats.
    pub down: bool,
    /// Last report time.
    pub last_heartbeat_ms: i64,
}

impl NodeInfo {
    /// Number of CPUs.
    pub fn nr_cpus(&self) -> u32 {
        self.topology.cpus.len() as u32
    }

    /// Capacity in the node-level engine: CPUs times the agent's
    /// oversubscription.
    pub fn slots(&self) -> u32 {
        self.nr_cpus().saturating_mul(self.oversubscribe.max(1))
    }

    /// The state shown to users.
    pub fn state(&self) -> NodeState {
        if self.down {
            NodeState::Down
        } else {
            match self.admin {
                NodeAdmin::Ready => NodeState::Ready,
                NodeAdmin::Cordoned => NodeState::Cordoned,
                NodeAdmin::Draining => NodeState::Draining,
            }
        }
    }

    /// Takes new jobs: up, connected and READY.
    pub fn schedulable(&self) -> bool {
        !self.down && self.connected && self.admin == NodeAdmin::Ready
    }

    /// Reachable for messages: connected and not DOWN.
    pub fn reachable(&self) -> bool {
        self.connected && !self.down
    }

    /// The order of the node-level engine's leaves: region, zone, rack,
    /// host group, name.
    pub fn order_key(&self) -> (&str, &str, &str, &str, &str) {
        (
            &self.region,
            &self.zone,
            &self.rack,
            &self.hostgroup,
            &self.name,
        )
    }

    /// Mark CPUs of the model busy for a job: the CPUs it reported, or
    /// (none reported yet) the aligned choice its agent will make.
    pub fn claim(&mut self, spec: &JobSpec, reported: Vec<LeafId>) -> Vec<LeafId> {
        let cpus = if reported.is_empty() {
            find_aligned_in(
                &self.cpu_topo,
                spec.cpus as usize,
                align_of(spec),
                policy_of(spec),
                None,
                |l| !self.cpu_busy[l],
            )
            .unwrap_or_default()
        } else {
            reported
        };
        for &c in &cpus {
            if let Some(b) = self.cpu_busy.get_mut(c)
                && !*b
            {
                *b = true;
                self.idle.add(c, -1);
            }
        }
        cpus
    }

    /// Mark CPUs of the model free again (a job ended or moved).
    pub fn release(&mut self, cpus: &[LeafId]) {
        for &c in cpus {
            if let Some(b) = self.cpu_busy.get_mut(c)
                && *b
            {
                *b = false;
                self.idle.add(c, 1);
            }
        }
    }

    /// The modelled free room per alignment level (equal to
    /// `free_summary_of` over `cpu_busy`, kept by difference).
    pub fn model_summary(&self) -> FreeSummary {
        self.idle.summary()
    }

    /// The room the engine is given for this node: its modelled free
    /// room, or none for an oversubscribed agent, which time-slices and
    /// aligns in its own queue (only its slot count limits placement).
    pub fn engine_room(&self) -> Option<FreeSummary> {
        (self.oversubscribe <= 1).then(|| self.model_summary())
    }

    /// The largest aligned room of the whole (empty) node, its memory
    /// (u64::MAX when unknown) and its GPUs.
    pub fn shape(&self) -> (FreeSummary, u64, u32) {
        (
            free_summary_of(&self.cpu_topo, |_| true),
            if self.memory_bytes == 0 {
                u64::MAX
            } else {
                self.memory_bytes
            },
            self.gpus,
        )
    }
}

/// Per alignment level (in [`Align::ALL`] order): the group of each CPU,
/// numbered in `align_groups` order, and the idle CPUs of each group. The
/// free summary is the largest count per level, so a start or finish
/// changes a few counters instead of visiting every CPU five times.
#[derive(Clone, Debug, Default)]
pub struct IdleCounts {
    group_of: [Vec<u32>; 5],
    idle: [Vec<u32>; 5],
}

impl IdleCounts {
    /// The counts of `topo` with the CPUs `is_idle` says are idle.
    pub fn new(topo: &Topology, is_idle: impl Fn(LeafId) -> bool) -> Self {
        let mut c = Self::default();
        for align in Align::ALL {
            let i = align.index();
            c.group_of[i] = vec![0; topo.nr_leaves()];
            for (g, group) in align_groups(topo, align).into_iter().enumerate() {
                let mut idle = 0;
                for &l in group {
                    c.group_of[i][l] = g as u32;
                    idle += u32::from(is_idle(l));
                }
                c.idle[i].push(idle);
            }
        }
        c
    }

    /// CPU `cpu` became idle (`delta` 1) or busy (-1).
    fn add(&mut self, cpu: LeafId, delta: i32) {
        for (group_of, idle) in self.group_of.iter().zip(self.idle.iter_mut()) {
            if let Some(n) = group_of.get(cpu).and_then(|&g| idle.get_mut(g as usize)) {
                *n = n.saturating_add_signed(delta);
            }
        }
    }

    /// The largest idle count per level.
    pub fn summary(&self) -> FreeSummary {
        let most = |a: Align| self.idle[a.index()].iter().copied().max().unwrap_or(0);
        FreeSummary {
            core: most(Align::Core),
            llc: most(Align::Llc),
            numa: most(Align::Numa),
            package: most(Align::Package),
            any: most(Align::Any),
        }
    }
}

/// The GPUs among reported devices.
pub fn count_gpus(devices: &[proto::v1::Device]) -> u32 {
    devices
        .iter()
        .filter(|d| d.kind == proto::v1::DeviceKind::Gpu as i32)
        .count() as u32
}

/// A node's place in the registry, stable for its name (a node is never
/// removed; registering again replaces it in place): where a caller
/// already knows the node (the engine's leaf, a job's modelled CPUs), it
/// reaches the node without hashing the name again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NodeSlot(u32);

impl NodeSlot {
    /// Its number (the registry's position of the node).
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// All nodes, by name.
#[derive(Default)]
pub struct Nodes {
    /// The nodes, in registration order (never removed: a node that
    /// registers again is replaced in place).
    slab: Vec<NodeInfo>,
    /// Each node's position in `slab`, in name order (what [`Nodes::iter`]
    /// follows).
    order: BTreeMap<String, usize>,
    /// The same positions, hashed: the lookups by name that every
    /// placement, start and finish makes (a B-tree of names compares
    /// ~log2(nodes) strings per lookup).
    index: IdMap<String, usize>,
    /// Administrative states restored from the store for nodes that have
    /// not registered yet.
    restored_admin: HashMap<String, NodeAdmin>,
    /// Engine trees of node topologies, by encoded topology. Bounded:
    /// a tree no node holds any more is dropped when another is added
    /// ([`Nodes::cpu_tree`]).
    topo_cache: HashMap<Vec<u8>, Arc<Topology>>,
    /// The reported topologies, one copy per distinct shape.
    pub(super) shapes: Shapes,
    /// A lower bound of the last heartbeat of every node that is not
    /// DOWN, as the last [`Nodes::overdue`] scan found it (lowered by
    /// [`Nodes::insert`]), with that scan's `now`; `None` until a scan.
    /// Heartbeat times only move forward and a node leaves DOWN only
    /// with a fresh one, so while `now - floor <= deadline` no node can
    /// be overdue and the tick skips the O(nodes) scan.
    heartbeat_floor: Option<(i64, i64)>,
}

impl Nodes {
    /// Remember administrative states from the store.
    pub fn restore_admin(&mut self, admin: HashMap<String, NodeAdmin>) {
        self.restored_admin = admin;
    }

    /// All nodes by name.
    pub fn iter(&self) -> impl Iterator<Item = &NodeInfo> {
        self.order.values().map(|&i| &self.slab[i])
    }

    /// All nodes by name, with their slots.
    pub fn iter_slots(&self) -> impl Iterator<Item = (NodeSlot, &NodeInfo)> {
        self.order
            .values()
            .map(|&i| (NodeSlot(i as u32), &self.slab[i]))
    }

    /// The nodes named after `name`, by name (every node when `name` is
    /// empty): a page of ListNodes starts here.
    pub fn iter_after<'a>(&'a self, name: &str) -> impl Iterator<Item = &'a NodeInfo> + 'a {
        use std::ops::Bound;
        let start = if name.is_empty() {
            Bound::Unbounded
        } else {
            Bound::Excluded(name)
        };
        self.order
            .range::<str, _>((start, Bound::Unbounded))
            .map(|(_, &i)| &self.slab[i])
    }

    /// Every node, to update in place, in registration order (the core's
    /// liveness scan, which updates each node from its own link: the order
    /// does not matter).
    pub(super) fn iter_mut(&mut self) -> impl Iterator<Item = &mut NodeInfo> {
        self.slab.iter_mut()
    }

    /// True without nodes.
    pub fn is_empty(&self) -> bool {
        self.slab.is_empty()
    }

    /// One node.
    pub fn get(&self, name: &str) -> Option<&NodeInfo> {
        self.index.get(name).map(|&i| &self.slab[i])
    }

    /// One node, to change.
    pub fn get_mut(&mut self, name: &str) -> Option<&mut NodeInfo> {
        self.index.get(name).map(|&i| &mut self.slab[i])
    }

    /// A node's slot.
    pub fn slot(&self, name: &str) -> Option<NodeSlot> {
        self.index.get(name).map(|&i| NodeSlot(i as u32))
    }

    /// The node in `slot`.
    pub fn at(&self, slot: NodeSlot) -> Option<&NodeInfo> {
        self.slab.get(slot.index())
    }

    /// The node in `slot`, to change.
    pub fn at_mut(&mut self, slot: NodeSlot) -> Option<&mut NodeInfo> {
        self.slab.get_mut(slot.index())
    }

    /// One node, or NOT_FOUND.
    pub fn find(&self, name: &str) -> Result<&NodeInfo, Status> {
        self.get(name)
            .ok_or_else(|| Status::not_found(format!("name: no node {name:?}")))
    }

    /// The engine tree of a reported topology (shared by nodes that
    /// report the same one: fleets are mostly identical machines).
    ///
    /// Before a new tree is cached, the trees only the cache still holds
    /// are dropped (their nodes re-registered with another topology): a
    /// hostile agent re-registering with a new topology each time keeps
    /// at most its current tree and the new one here, so the cache holds
    /// at most one tree per node plus one.
    pub fn cpu_tree(&mut self, topology: &proto::v1::Topology) -> Result<Arc<Topology>, String> {
        let shape = prost::Message::encode_to_vec(topology);
        if let Some(t) = self.topo_cache.get(&shape) {
            return Ok(t.clone());
        }
        let t = Arc::new(engine_proto::cpu_topology(topology).map_err(|e| e.to_string())?);
        self.topo_cache.retain(|_, t| Arc::strong_count(t) > 1);
        self.topo_cache.insert(shape, t.clone());
        Ok(t)
    }

    /// Engine trees in the topology cache.
    pub fn cached_trees(&self) -> usize {
        self.topo_cache.len()
    }

    /// The administrative state a (re-)registering node keeps.
    pub fn admin_of(&self, name: &str) -> NodeAdmin {
        self.get(name)
            .map(|n| n.admin)
            .or_else(|| self.restored_admin.get(name).copied())
            .unwrap_or(NodeAdmin::Ready)
    }

    /// Insert or replace a node; returns the one it replaced.
    pub fn insert(&mut self, node: NodeInfo) -> Option<NodeInfo> {
        if let Some((floor, _)) = self.heartbeat_floor.as_mut()
            && !node.down
        {
            *floor = (*floor).min(node.last_heartbeat_ms);
        }
        match self.index.get(&node.name) {
            Some(&i) => Some(std::mem::replace(&mut self.slab[i], node)),
            None => {
                let i = self.slab.len();
                self.index.insert(node.name.clone(), i);
                self.order.insert(node.name.clone(), i);
                self.slab.push(node);
                None
            }
        }
    }

    /// Nodes whose last report is older than `deadline_ms` and not DOWN yet.
    ///
    /// O(1) while every node's heartbeat is younger than the deadline
    /// measured from the oldest one the last scan saw (the floor), else a
    /// scan of every node that renews the floor. A clock that went back
    /// since that scan forces the scan.
    pub fn overdue(&mut self, now: i64, deadline_ms: i64) -> Vec<String> {
        if let Some((floor, scanned_at)) = self.heartbeat_floor
            && now >= scanned_at
            && now.saturating_sub(floor) <= deadline_ms
        {
            return Vec::new();
        }
        // Starting from `now`: a node that leaves DOWN or registers
        // later gets a heartbeat at or after it.
        let mut floor = now;
        let mut out = Vec::new();
        for n in self
            .order
            .values()
            .map(|&i| &self.slab[i])
            .filter(|n| !n.down)
        {
            if now - n.last_heartbeat_ms > deadline_ms {
                out.push(n.name.clone());
            }
            floor = floor.min(n.last_heartbeat_ms);
        }
        // The overdue nodes hold the floor down until they are DOWN: the
        // next call scans again and finds the floor without them.
        self.heartbeat_floor = Some((floor, now));
        out
    }
}

/// A node's state as metrics and the web page name it: ready / down /
/// disconnected / draining / cordoned.
pub fn node_state(n: &NodeInfo) -> &'static str {
    if n.down {
        "down"
    } else if !n.connected {
        "disconnected"
    } else {
        match n.admin {
            NodeAdmin::Draining => "draining",
            NodeAdmin::Cordoned => "cordoned",
            NodeAdmin::Ready => "ready",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::register_node;
    use super::super::{Cluster, ClusterConfig, Effects};
    use super::*;
    use proptest::prelude::*;
    use std::sync::Arc;

    /// A ready, connected node with the CPU model of `topo` and nothing
    /// else known about it.
    fn bare_node(name: String, topo: &Arc<Topology>) -> NodeInfo {
        NodeInfo {
            name,
            labels: Arc::default(),
            zone: String::new(),
            rack: String::new(),
            hostgroup: String::new(),
            region: String::new(),
            topology: Default::default(),
            cpu_busy: vec![false; topo.nr_leaves()],
            idle: IdleCounts::new(topo, |_| true),
            cpu_topo: topo.clone(),
            memory_bytes: 0,
            devices: Vec::new(),
            gpus: 0,
            oversubscribe: 1,
            load: Default::default(),
            admin: NodeAdmin::Ready,
            connected: true,
            down: false,
            last_heartbeat_ms: 0,
        }
    }

    proptest! {
        /// The registry's slab and hashed index answer as the B-tree of
        /// names it replaced: after any sequence of registrations (new
        /// names and re-registrations replacing a node), every lookup by
        /// name, `insert`'s returned node, iteration in name order and the
        /// overdue scan equal the `BTreeMap<String, NodeInfo>` oracle's.
        #[test]
        fn registry_answers_like_a_map_by_name(
            regs in proptest::collection::vec((0usize..12, 0i64..100, any::<bool>()), 1..40),
            now in 0i64..200,
        ) {
            let topo = Arc::new(Topology::from_spec("1s:2c:1t").unwrap());
            let node = |name: String, beat: i64, down: bool| NodeInfo {
                down,
                last_heartbeat_ms: beat,
                ..bare_node(name, &topo)
            };
            let mut nodes = Nodes::default();
            let mut oracle: BTreeMap<String, NodeInfo> = BTreeMap::new();
            for (n, beat, down) in regs {
                let name = format!("n{}", (n * 7) % 12);
                let got = nodes.insert(node(name.clone(), beat, down));
                let want = oracle.insert(name.clone(), node(name, beat, down));
                prop_assert_eq!(
                    got.map(|g| g.last_heartbeat_ms),
                    want.map(|w| w.last_heartbeat_ms)
                );
                let names: Vec<&str> = nodes.iter().map(|n| n.name.as_str()).collect();
                let want: Vec<&str> = oracle.keys().map(String::as_str).collect();
                prop_assert_eq!(names, want);
                for i in 0..13 {
                    let name = format!("n{i}");
                    prop_assert_eq!(
                        nodes.get(&name).map(|n| (n.last_heartbeat_ms, n.down)),
                        oracle.get(&name).map(|n| (n.last_heartbeat_ms, n.down))
                    );
                }
            }
            let want: Vec<String> = oracle
                .values()
                .filter(|n| !n.down && now - n.last_heartbeat_ms > 50)
                .map(|n| n.name.clone())
                .collect();
            prop_assert_eq!(nodes.overdue(now, 50), want);
        }

        /// The idle counts kept by difference give the summary the
        /// brute-force `free_summary_of` computes over the CPU model, after
        /// any sequence of claims (aligned choices or reported CPUs, which
        /// may overlap busy ones) and releases.
        #[test]
        fn idle_counts_match_the_recomputed_summary(
            spec in prop_oneof![Just("2s:8c:2t"), Just("1s:4c:1t"), Just("2s:3c:2t:llc=2")],
            ops in proptest::collection::vec((0u32..3, 0u32..10, 0usize..5, any::<bool>()), 1..40),
        ) {
            let topo = Arc::new(Topology::from_spec(spec).unwrap());
            let n = topo.nr_leaves();
            let mut node = bare_node("n".into(), &topo);
            let mut held: Vec<Vec<LeafId>> = Vec::new();
            for (op, cpus, align, pack) in ops {
                match op {
                    0 => {
                        let spec = JobSpec {
                            cpus: cpus.max(1),
                            alignment: align as i32,
                            policy: i32::from(pack),
                            ..Default::default()
                        };
                        held.push(node.claim(&spec, Vec::new()));
                    }
                    1 => {
                        let reported: Vec<LeafId> =
                            (0..cpus as usize).map(|i| (i * 7 + align) % n).collect();
                        held.push(node.claim(&JobSpec::default(), reported));
                    }
                    _ => {
                        if !held.is_empty() {
                            let cpus = held.swap_remove(cpus as usize % held.len());
                            node.release(&cpus);
                        }
                    }
                }
                let brute = free_summary_of(&topo, |l| !node.cpu_busy[l]);
                prop_assert_eq!(node.model_summary(), brute);
            }
        }
    }

    /// A node that re-registers with a new topology every time (a hostile
    /// agent with a valid certificate: its name is fixed by it) leaves the
    /// cache at one tree per node plus one, and nodes reporting the same
    /// topology still share one tree.
    #[test]
    fn topology_cache_holds_only_trees_in_use() {
        let mut c = Cluster::new(ClusterConfig::default());
        let mut fx = Effects::default();
        register_node(&mut c, "a", "2s:4c:2t", ("z", "r1"), 0, &mut fx);
        register_node(&mut c, "b", "2s:4c:2t", ("z", "r2"), 0, &mut fx);
        let mut most = 0;
        for (i, (sockets, cores)) in (1..=8)
            .flat_map(|s| (1..=40).map(move |c| (s, c)))
            .enumerate()
        {
            let spec = format!("{sockets}s:{cores}c:1t");
            register_node(&mut c, "evil", &spec, ("z", "r3"), i as i64, &mut fx);
            c.settle(i as i64, &mut fx);
            most = most.max(c.nodes.cached_trees());
        }
        // a and b share one tree; evil holds one; one more while a new
        // tree is added before the node drops its old one.
        assert!(most <= 3, "the cache grew to {most} trees for 3 nodes");
        let a = c.nodes.get("a").unwrap().cpu_topo.clone();
        assert!(Arc::ptr_eq(&a, &c.nodes.get("b").unwrap().cpu_topo));
        // The honest nodes' tree survived every eviction.
        register_node(&mut c, "d", "2s:4c:2t", ("z", "r4"), 999, &mut fx);
        assert!(Arc::ptr_eq(&a, &c.nodes.get("d").unwrap().cpu_topo));
    }

    /// One sequence of (op, node, ms) for
    /// [`overdue_with_the_floor_matches_a_full_scan`]; returns how many
    /// nodes went DOWN.
    fn heartbeat_run(ops: &[(u8, usize, i64)]) -> Result<usize, TestCaseError> {
        let cfg = ClusterConfig::default();
        let deadline = (cfg.heartbeat_interval_ms * cfg.missed_heartbeats) as i64;
        let mut c = Cluster::new(cfg);
        let mut fx = Effects::default();
        let names = ["a", "b", "c", "d"];
        // Per node: registered, last heartbeat, down, connected.
        let mut model: [(bool, i64, bool, bool); 4] = [(false, 0, false, false); 4];
        let mut now = 0i64;
        let mut downs = 0;
        for &(op, i, dt) in ops {
            let name = names[i];
            match op {
                0 => {
                    register_node(&mut c, name, "1s:2c:1t", ("z", "r"), now, &mut fx);
                    model[i] = (true, now, false, true);
                }
                1 if model[i].0 => {
                    c.load_report_time(name, now);
                    model[i].1 = now;
                }
                2 if model[i].0 => {
                    c.load_report(name, proto::v1::NodeLoad::default(), now, &mut fx);
                    model[i].1 = now;
                    if model[i].2 && model[i].3 {
                        model[i].2 = false;
                    }
                }
                3 if model[i].0 => {
                    c.disconnected(name);
                    model[i].3 = false;
                }
                4 => {
                    c.tick(now, &mut fx);
                    for m in model.iter_mut() {
                        if m.0 && !m.2 && now - m.1 > deadline {
                            m.2 = true;
                            downs += 1;
                        }
                    }
                }
                _ => now += dt,
            }
            for (j, m) in model.iter().enumerate() {
                if m.0 {
                    prop_assert_eq!(
                        c.nodes.get(names[j]).unwrap().down,
                        m.2,
                        "node {}",
                        names[j]
                    );
                }
            }
        }
        Ok(downs)
    }

    /// `overdue` with its heartbeat floor marks exactly the nodes a scan
    /// of every node would, tick after tick: against a model of each
    /// node's last heartbeat and DOWN flag under registrations,
    /// heartbeats, reports that revive, disconnects and ticks. Fails too
    /// when the cases marked too few nodes DOWN to show anything.
    #[test]
    fn overdue_with_the_floor_matches_a_full_scan() {
        let mut runner = proptest::test_runner::TestRunner::default();
        let downs = std::cell::Cell::new(0usize);
        runner
            .run(
                &proptest::collection::vec((0u8..6, 0usize..4, 0i64..2500), 1..120),
                |ops| {
                    downs.set(downs.get() + heartbeat_run(&ops)?);
                    Ok(())
                },
            )
            .unwrap();
        assert!(downs.get() > 100, "nodes marked DOWN: {}", downs.get());
    }
}
