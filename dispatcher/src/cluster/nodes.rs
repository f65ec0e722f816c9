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

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use proto::v1::{JobSpec, NodeState};
use sched::alloc::find_aligned_in_bits;
use sched::idhash::IdHasher;
use sched::{FreeSummary, LeafId, Topology};
use tonic::Status;

use super::load::PackedLoad;
use super::shapes::{CpuShape, Devices, IdleCounts, Labels, Shapes, Strings};
use crate::record::NodeName;
use crate::spec::{align_of, policy_of};
use crate::store::NodeAdmin;

/// A node as the dispatcher knows it. What nodes of one model have in
/// common is shared ([`super::shapes`]): its reported topology, its CPU
/// shape, its label strings and device list; its own are its name, the
/// busy bits of its CPU model and the numbers. The record is boxed in
/// the registry, so that the registry's slab grows by pointers.
#[derive(Clone, Debug)]
pub struct NodeInfo {
    /// Unique name (shared with the job phases, records, agent messages
    /// and moves that name the node).
    pub name: NodeName,
    /// Labels (shared with the API views' copies: `listing.rs`).
    pub labels: Labels,
    /// Region, zone, rack and host group derived from labels (shared by
    /// the nodes of one place: [`Places`]).
    place: Arc<Place>,
    /// The topology as reported (shared by nodes that report the same
    /// one: [`Shapes`]).
    pub topology: Arc<proto::v1::Topology>,
    /// The same as an engine tree over CPU numbers and its alignment
    /// groups (shared likewise: [`Nodes::cpu_tree`]).
    cpu: Arc<CpuShape>,
    /// The dispatcher's model of which CPUs its jobs hold: bit `c` of word
    /// `c / 64` for dense CPU `c`. Changed only by [`NodeInfo::claim`]
    /// and [`NodeInfo::release`], which keep `idle` in step.
    busy: Box<[u64]>,
    /// The model's idle CPUs per alignment group (its free summary kept
    /// by difference; the groups are the shape's).
    idle: IdleCounts,
    /// Memory offered to jobs.
    pub memory_bytes: u64,
    /// The PCI devices its agent reported (GPUs, accelerators, NICs;
    /// shared by nodes that report the same list: [`Devices`]).
    pub devices: Arc<[proto::v1::Device]>,
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
    /// A ready, connected node `name` of CPU shape `cpu` with every CPU
    /// idle, reported at `now`; the rest empty (the caller fills it).
    pub fn new(
        name: impl Into<NodeName>,
        topology: Arc<proto::v1::Topology>,
        cpu: Arc<CpuShape>,
        now: i64,
    ) -> Self {
        Self {
            name: name.into(),
            labels: Labels::default(),
            place: Arc::default(),
            topology,
            busy: cpu.idle_bits(),
            idle: cpu.idle_counts(),
            cpu,
            memory_bytes: 0,
            devices: Arc::new([]),
            gpus: 0,
            oversubscribe: 1,
            load: PackedLoad::default(),
            admin: NodeAdmin::Ready,
            connected: true,
            down: false,
            last_heartbeat_ms: now,
        }
    }

    /// Its place: region, zone, rack, host group.
    pub fn place(&self) -> &Arc<Place> {
        &self.place
    }

    /// Set its place (interned: [`Places::intern`]).
    pub fn set_place(&mut self, place: Arc<Place>) {
        self.place = place;
    }

    /// Zone.
    pub fn zone(&self) -> &str {
        &self.place.zone
    }

    /// Rack.
    pub fn rack(&self) -> &str {
        &self.place.rack
    }

    /// Host group ("" when unlabelled: the node is its own group).
    pub fn hostgroup(&self) -> &str {
        &self.place.hostgroup
    }

    /// Region.
    pub fn region(&self) -> &str {
        &self.place.region
    }

    /// Number of CPUs.
    pub fn nr_cpus(&self) -> u32 {
        self.topology.cpus.len() as u32
    }

    /// The engine tree over its CPUs (for alignment).
    pub fn cpu_topo(&self) -> &Arc<Topology> {
        self.cpu.tree()
    }

    /// Its CPU shape (shared by the nodes of its model).
    pub fn cpu_shape(&self) -> &Arc<CpuShape> {
        &self.cpu
    }

    /// True when the model has dense CPU `cpu` busy.
    pub fn is_busy(&self, cpu: LeafId) -> bool {
        self.busy
            .get(cpu / 64)
            .is_some_and(|w| w & (1 << (cpu % 64)) != 0)
    }

    /// The model's busy flag of each dense CPU, in order.
    pub fn busy_flags(&self) -> impl Iterator<Item = bool> + '_ {
        (0..self.cpu.nr_cpus()).map(|c| self.is_busy(c))
    }

    /// The model's busy CPUs.
    pub fn busy_cpus(&self) -> u32 {
        self.busy.iter().map(|w| w.count_ones()).sum()
    }

    /// Set or clear dense CPU `cpu` in the model; true when it changed.
    fn set_busy(&mut self, cpu: LeafId, busy: bool) -> bool {
        if cpu >= self.cpu.nr_cpus() {
            return false;
        }
        let Some(w) = self.busy.get_mut(cpu / 64) else {
            return false;
        };
        let bit = 1u64 << (cpu % 64);
        let was = *w & bit != 0;
        if busy {
            *w |= bit;
        } else {
            *w &= !bit;
        }
        was != busy
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
            self.region(),
            self.zone(),
            self.rack(),
            self.hostgroup(),
            &self.name,
        )
    }

    /// Mark CPUs of the model busy for a job: the CPUs it reported, or
    /// (none reported yet) the aligned choice its agent will make.
    pub fn claim(&mut self, spec: &JobSpec, reported: Vec<LeafId>) -> Vec<LeafId> {
        let cpus = if reported.is_empty() {
            find_aligned_in_bits(
                self.cpu.tree(),
                spec.cpus as usize,
                align_of(spec),
                policy_of(spec),
                &self.busy,
            )
            .unwrap_or_default()
        } else {
            reported
        };
        for &c in &cpus {
            if self.set_busy(c, true) {
                self.cpu.add(&mut self.idle, c, -1);
            }
        }
        cpus
    }

    /// Mark CPUs of the model free again (a job ended or moved).
    pub fn release(&mut self, cpus: &[LeafId]) {
        for &c in cpus {
            if self.set_busy(c, false) {
                self.cpu.add(&mut self.idle, c, 1);
            }
        }
    }

    /// The modelled free room per alignment level (equal to
    /// `free_summary_of` over the busy CPUs, kept by difference).
    pub fn model_summary(&self) -> FreeSummary {
        self.cpu.summary(&self.idle)
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
            self.cpu.whole(),
            if self.memory_bytes == 0 {
                u64::MAX
            } else {
                self.memory_bytes
            },
            self.gpus,
        )
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

    /// The slot a name carries: the registry's slot of the node it names
    /// when the registry made it ([`NodeName::slot`]).
    pub fn of(name: &NodeName) -> Option<NodeSlot> {
        name.slot().map(NodeSlot)
    }
}

/// A node's place in the cluster, from its labels: shared by the nodes of
/// one place ([`Places`]), so a node holds a pointer where it held four
/// strings (96 bytes and their copies, issue 14).
#[derive(Debug, Default, PartialEq, Eq, Hash)]
pub struct Place {
    /// Region.
    pub region: String,
    /// Zone.
    pub zone: String,
    /// Rack.
    pub rack: String,
    /// Host group ("" when unlabelled: the node is its own group).
    pub hostgroup: String,
}

/// The nodes' places, each held once. Bounded as [`Strings`]: when the
/// set has doubled since the last sweep, places no node holds any more
/// are dropped.
#[derive(Debug, Default)]
pub struct Places {
    set: HashSet<Arc<Place>>,
    /// Places held after the last sweep.
    swept: usize,
}

impl Places {
    /// The shared copy of `place`.
    pub fn intern(&mut self, place: Place) -> Arc<Place> {
        if let Some(x) = self.set.get(&place) {
            return x.clone();
        }
        if self.set.len() >= 2 * self.swept + 1024 {
            self.set.retain(|x| Arc::strong_count(x) > 1);
            self.swept = self.set.len();
        }
        let x = Arc::new(place);
        self.set.insert(x.clone());
        x
    }

    /// Places held.
    pub fn len(&self) -> usize {
        self.set.len()
    }

    /// True when none is held.
    pub fn is_empty(&self) -> bool {
        self.set.is_empty()
    }
}

/// Positions (in a table of named things: the registry's slab, the
/// engine's leaves) hashed by the name at the position: a lookup by name
/// without a copy of the name. 4 bytes a bucket (and hashbrown's control
/// byte) where a map from a `String` copy was 32 and the copy; the names
/// are read from the table the caller passes (`name_of`), which must be
/// the one the positions were inserted with.
#[derive(Clone, Debug, Default)]
pub(crate) struct NameIndex(hashbrown::HashTable<u32>);

impl NameIndex {
    fn hash(name: &str) -> u64 {
        use std::hash::BuildHasher;
        std::hash::BuildHasherDefault::<IdHasher>::default().hash_one(name)
    }

    /// The position of `name` (`name_of(position)` is the name there).
    #[inline]
    pub(crate) fn get<'a>(&self, name: &str, name_of: impl Fn(usize) -> &'a str) -> Option<usize> {
        self.0
            .find(Self::hash(name), |&i| name_of(i as usize) == name)
            .map(|&i| i as usize)
    }

    /// Index a name not indexed yet at position `at`.
    pub(crate) fn insert<'a>(&mut self, name: &str, at: usize, name_of: impl Fn(usize) -> &'a str) {
        debug_assert!(u32::try_from(at).is_ok(), "a position beyond u32");
        self.0.insert_unique(Self::hash(name), at as u32, |&i| {
            Self::hash(name_of(i as usize))
        });
    }

    /// Index `names` at their positions, in a table sized for them once.
    pub(crate) fn of(names: &[impl AsRef<str>]) -> Self {
        let mut t = hashbrown::HashTable::with_capacity(names.len());
        for (i, n) in names.iter().enumerate() {
            t.insert_unique(Self::hash(n.as_ref()), i as u32, |&j| {
                Self::hash(names[j as usize].as_ref())
            });
        }
        Self(t)
    }

    /// Forget every position.
    pub(crate) fn clear(&mut self) {
        self.0.clear();
    }
}

/// All nodes, by name.
#[derive(Default)]
pub struct Nodes {
    /// The nodes, in registration order (never removed: a node that
    /// registers again is replaced in place). Boxed: the slab's spare
    /// capacity (up to as much again as it holds) is pointers, not
    /// records.
    #[allow(clippy::vec_box)] // the spare capacity as pointers (node_bytes)
    slab: Vec<Box<NodeInfo>>,
    /// The nodes' positions in `slab`, in name order (what [`Nodes::iter`]
    /// follows): 4 bytes a node where a B-tree of names kept a copy of
    /// each name; a new node's position is inserted in place (a move of
    /// the positions after it, once per node ever registered).
    order: Vec<u32>,
    /// The same positions, hashed: the lookups by name that every
    /// placement, start and finish makes (a B-tree of names compares
    /// ~log2(nodes) strings per lookup).
    index: NameIndex,
    /// Administrative states restored from the store for nodes that have
    /// not registered yet.
    restored_admin: HashMap<String, NodeAdmin>,
    /// CPU shapes (engine trees and their alignment groups) of node
    /// topologies, by encoded topology. Bounded: a shape no node holds
    /// any more is dropped when another is added ([`Nodes::cpu_tree`]).
    topo_cache: HashMap<Box<[u8]>, Arc<CpuShape>>,
    /// The reported topologies, one copy per distinct shape.
    pub(super) shapes: Shapes,
    /// Bumped by every change that may reach a node ([`Nodes::changes`]).
    changes: u64,
    /// Label keys and values, one copy each.
    pub(super) strings: Strings,
    /// The nodes' places, one copy each.
    pub(super) places: Places,
    /// Reported device lists, one copy per distinct list.
    pub(super) devices: Devices,
    /// A lower bound of the last heartbeat of every node that is not
    /// DOWN, as the last [`Nodes::overdue`] scan found it (lowered by
    /// [`Nodes::insert`]), with that scan's `now`; `None` until a scan.
    /// Heartbeat times only move forward and a node leaves DOWN only
    /// with a fresh one, so while `now - floor <= deadline` no node can
    /// be overdue and the tick skips the O(nodes) scan.
    heartbeat_floor: Option<(i64, i64)>,
}

impl Nodes {
    /// A counter bumped by every access that may change a node (or the
    /// set): equal counters, no change in between (the gang pass skips
    /// on it).
    pub fn changes(&self) -> u64 {
        self.changes
    }

    /// Remember administrative states from the store.
    pub fn restore_admin(&mut self, admin: HashMap<String, NodeAdmin>) {
        self.changes += 1;
        self.restored_admin = admin;
    }

    /// All nodes by name.
    pub fn iter(&self) -> impl Iterator<Item = &NodeInfo> {
        self.order.iter().map(|&i| &*self.slab[i as usize])
    }

    /// All nodes by name, with their slots.
    pub fn iter_slots(&self) -> impl Iterator<Item = (NodeSlot, &NodeInfo)> {
        self.order
            .iter()
            .map(|&i| (NodeSlot(i), &*self.slab[i as usize]))
    }

    /// The nodes named after `name`, by name (every node when `name` is
    /// empty): a page of ListNodes starts here.
    pub fn iter_after<'a>(&'a self, name: &str) -> impl Iterator<Item = &'a NodeInfo> + 'a {
        let start = if name.is_empty() {
            0
        } else {
            self.order
                .partition_point(|&i| self.slab[i as usize].name.as_str() <= name)
        };
        self.order[start..].iter().map(|&i| &*self.slab[i as usize])
    }

    /// Every node, to update in place, in registration order (the core's
    /// liveness scan, which updates each node from its own link: the order
    /// does not matter).
    pub(super) fn iter_mut(&mut self) -> impl Iterator<Item = &mut NodeInfo> {
        self.changes += 1;
        self.slab.iter_mut().map(|n| &mut **n)
    }

    /// True without nodes.
    pub fn is_empty(&self) -> bool {
        self.slab.is_empty()
    }

    /// One node.
    pub fn get(&self, name: &str) -> Option<&NodeInfo> {
        self.index
            .get(name, |i| &self.slab[i].name)
            .map(|i| &*self.slab[i])
    }

    /// One node, to change.
    pub fn get_mut(&mut self, name: &str) -> Option<&mut NodeInfo> {
        self.changes += 1;
        let i = self.index.get(name, |i| &self.slab[i].name)?;
        Some(&mut *self.slab[i])
    }

    /// A node's slot.
    pub fn slot(&self, name: &str) -> Option<NodeSlot> {
        self.index
            .get(name, |i| &self.slab[i].name)
            .map(|i| NodeSlot(i as u32))
    }

    /// The node in `slot`.
    pub fn at(&self, slot: NodeSlot) -> Option<&NodeInfo> {
        self.slab.get(slot.index()).map(|n| &**n)
    }

    /// The node in `slot`, to change.
    pub fn at_mut(&mut self, slot: NodeSlot) -> Option<&mut NodeInfo> {
        self.changes += 1;
        self.slab.get_mut(slot.index()).map(|n| &mut **n)
    }

    /// One node, or NOT_FOUND.
    pub fn find(&self, name: &str) -> Result<&NodeInfo, Status> {
        self.get(name)
            .ok_or_else(|| Status::not_found(format!("name: no node {name:?}")))
    }

    /// The CPU shape (engine tree and alignment groups) of a reported
    /// topology (shared by nodes that report the same one: fleets are
    /// mostly identical machines).
    ///
    /// Before a new tree is cached, the trees only the cache still holds
    /// are dropped (their nodes re-registered with another topology): a
    /// hostile agent re-registering with a new topology each time keeps
    /// at most its current tree and the new one here, so the cache holds
    /// at most one tree per node plus one.
    pub fn cpu_tree(&mut self, topology: &proto::v1::Topology) -> Result<Arc<CpuShape>, String> {
        let shape = prost::Message::encode_to_vec(topology).into_boxed_slice();
        if let Some(t) = self.topo_cache.get(&shape) {
            return Ok(t.clone());
        }
        let t = Arc::new(CpuShape::new(
            engine_proto::cpu_topology(topology).map_err(|e| e.to_string())?,
        ));
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

    /// Insert or replace a node; returns the one it replaced. Its name
    /// takes its slot ([`NodeName::slot`]).
    pub fn insert(&mut self, mut node: NodeInfo) -> Option<NodeInfo> {
        self.changes += 1;
        if let Some((floor, _)) = self.heartbeat_floor.as_mut()
            && !node.down
        {
            *floor = (*floor).min(node.last_heartbeat_ms);
        }
        match self.index.get(&node.name, |i| &self.slab[i].name) {
            Some(i) => {
                node.name = std::mem::take(&mut node.name).in_slot(i as u32);
                Some(std::mem::replace(&mut *self.slab[i], node))
            }
            None => {
                let i = self.slab.len();
                node.name = std::mem::take(&mut node.name).in_slot(i as u32);
                let slab = &self.slab;
                self.index.insert(&node.name, i, |j| &slab[j].name);
                let at = self
                    .order
                    .partition_point(|&j| self.slab[j as usize].name < node.name);
                self.order.insert(at, i as u32);
                self.slab.push(Box::new(node));
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
            .iter()
            .map(|&i| &*self.slab[i as usize])
            .filter(|n| !n.down)
        {
            if now - n.last_heartbeat_ms > deadline_ms {
                out.push(n.name.to_string());
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
    use sched::alloc::{find_aligned_in, free_summary_of};
    use std::collections::BTreeMap;
    use std::sync::Arc;

    /// A ready, connected node of CPU shape `cpu` and nothing else
    /// known about it.
    fn bare_node(name: String, cpu: &Arc<CpuShape>) -> NodeInfo {
        NodeInfo::new(name, Arc::default(), cpu.clone(), 0)
    }

    /// The CPU shape of a spec, unshared.
    fn cpu_shape(spec: &str) -> Arc<CpuShape> {
        Arc::new(CpuShape::new(Topology::from_spec(spec).unwrap()))
    }

    proptest! {
        /// The registry's slab and hashed index answer as the B-tree of
        /// names it replaced: after any sequence of registrations (new
        /// names and re-registrations replacing a node), every lookup by
        /// name, `insert`'s returned node, iteration in name order (whole and
        /// after a name: the sorted positions) and the
        /// overdue scan equal the `BTreeMap<String, NodeInfo>` oracle's.
        #[test]
        fn registry_answers_like_a_map_by_name(
            regs in proptest::collection::vec((0usize..12, 0i64..100, any::<bool>()), 1..40),
            now in 0i64..200,
        ) {
            let topo = cpu_shape("1s:2c:1t");
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
                // Pages start after any name, present or not ("" = all).
                for after in ["", "n", "n0", "n3", "n35", "n9", "o"] {
                    let got: Vec<&str> =
                        nodes.iter_after(after).map(|n| n.name.as_str()).collect();
                    let want: Vec<&str> = oracle
                        .keys()
                        .filter(|k| after.is_empty() || k.as_str() > after)
                        .map(String::as_str)
                        .collect();
                    prop_assert_eq!(got, want, "after {:?}", after);
                }
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
                .map(|n| n.name.to_string())
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
            let shape = cpu_shape(spec);
            let topo = shape.tree().clone();
            let n = topo.nr_leaves();
            let mut node = bare_node("n".into(), &shape);
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
                let brute = free_summary_of(&topo, |l| !node.is_busy(l));
                prop_assert_eq!(node.model_summary(), brute);
            }
        }
    }

    /// The machine shapes of [`shared_shapes_answer_as_private_models`]:
    /// one word, several words (80 and 96 CPUs), split LLCs, one CPU.
    const SPECS: [&str; 5] = [
        "2s:8c:2t",
        "2s:20c:2t",
        "2s:3c:2t:llc=2",
        "4s:6c:2t:numa=2",
        "1s:1c:1t",
    ];

    proptest! {
        /// A [`NameIndex`] answers as a map from name to position (the
        /// oracle, a `HashMap` of name copies): built whole
        /// (`NameIndex::of`) or one name at a time (through the growth's
        /// rehashes), every indexed name is found at its position and no
        /// other name is found; names that share prefixes, lengths and
        /// 8-byte words included.
        #[test]
        fn a_name_index_answers_as_a_map_of_names(
            names in proptest::collection::hash_set("[ab]{0,3}[a-c0-9-]{0,12}", 0..200),
            probes in proptest::collection::vec("[ab]{0,3}[a-c0-9-]{0,12}", 0..50),
        ) {
            let names: Vec<String> = names.into_iter().collect();
            let oracle: HashMap<&str, usize> =
                names.iter().enumerate().map(|(i, n)| (n.as_str(), i)).collect();
            let whole = NameIndex::of(&names);
            let mut grown = NameIndex::default();
            for (i, n) in names.iter().enumerate() {
                grown.insert(n, i, |j| &names[j]);
            }
            for n in names.iter().chain(&probes) {
                let want = oracle.get(n.as_str()).copied();
                prop_assert_eq!(whole.get(n, |j| &names[j]), want, "built whole: {:?}", n);
                prop_assert_eq!(grown.get(n, |j| &names[j]), want, "grown: {:?}", n);
            }
            grown.clear();
            prop_assert_eq!(grown.get("a", |j| &names[j]), None);
        }
    }

    proptest! {
        /// Nodes that share one CPU shape (got from the registry's cache,
        /// as registration gets it) answer every query of the CPU model as
        /// a node with its own private tree and a plain busy flag per CPU
        /// would (the brute-force oracle: `find_aligned_in` and
        /// `free_summary_of` over the flags), after any interleaving of
        /// claims (aligned choices, reported CPUs, some out of range) and
        /// releases on any of them: the CPUs a claim picks, the free
        /// summary, the whole node's room, the busy flags and count.
        #[test]
        fn shared_shapes_answer_as_private_models(
            kinds in proptest::collection::vec(0usize..SPECS.len(), 1..6),
            ops in proptest::collection::vec(
                (0usize..6, 0u32..3, 0u32..24, 0usize..5, any::<bool>()),
                1..60,
            ),
        ) {
            let mut registry = Nodes::default();
            let mut nodes = Vec::new();
            // Per node: its private tree and busy flags, the oracle.
            let mut oracle: Vec<(Topology, Vec<bool>)> = Vec::new();
            for (i, &k) in kinds.iter().enumerate() {
                let tree = Topology::from_spec(SPECS[k]).unwrap();
                let shape = registry.cpu_tree(&engine_proto::topology(&tree)).unwrap();
                nodes.push(bare_node(format!("n{i}"), &shape));
                let private = engine_proto::cpu_topology(&engine_proto::topology(&tree)).unwrap();
                let n = private.nr_leaves();
                oracle.push((private, vec![false; n]));
            }
            for (a, x) in kinds.iter().enumerate() {
                for (b, y) in kinds.iter().enumerate() {
                    prop_assert_eq!(
                        Arc::ptr_eq(nodes[a].cpu_shape(), nodes[b].cpu_shape()),
                        x == y
                    );
                }
            }
            let mut held: Vec<(usize, Vec<LeafId>)> = Vec::new();
            for (at, op, cpus, align, pack) in ops {
                let at = at % nodes.len();
                let (tree, busy) = &mut oracle[at];
                let n = tree.nr_leaves();
                match op {
                    0 => {
                        let spec = JobSpec {
                            cpus: cpus.max(1),
                            alignment: align as i32,
                            policy: i32::from(pack),
                            ..Default::default()
                        };
                        let want = find_aligned_in(
                            tree,
                            spec.cpus as usize,
                            align_of(&spec),
                            policy_of(&spec),
                            None,
                            |l| !busy[l],
                        )
                        .unwrap_or_default();
                        let got = nodes[at].claim(&spec, Vec::new());
                        prop_assert_eq!(&got, &want);
                        for &c in &want {
                            busy[c] = true;
                        }
                        held.push((at, got));
                    }
                    1 => {
                        // Reported CPUs; one past the end when `pack`.
                        let mut reported: Vec<LeafId> =
                            (0..cpus as usize).map(|i| (i * 7 + align) % n).collect();
                        if pack {
                            reported.push(n + align);
                        }
                        let got = nodes[at].claim(&JobSpec::default(), reported.clone());
                        prop_assert_eq!(&got, &reported);
                        for &c in &reported {
                            if let Some(b) = busy.get_mut(c) {
                                *b = true;
                            }
                        }
                        held.push((at, got));
                    }
                    _ => {
                        if !held.is_empty() {
                            let (on, cpus) = held.swap_remove(cpus as usize % held.len());
                            nodes[on].release(&cpus);
                            for &c in &cpus {
                                if let Some(b) = oracle[on].1.get_mut(c) {
                                    *b = false;
                                }
                            }
                        }
                    }
                }
                for (node, (tree, busy)) in nodes.iter().zip(&oracle) {
                    prop_assert_eq!(
                        node.model_summary(),
                        free_summary_of(tree, |l| !busy[l])
                    );
                    prop_assert_eq!(node.shape().0, free_summary_of(tree, |_| true));
                    prop_assert_eq!(node.busy_flags().collect::<Vec<_>>(), busy.clone());
                    prop_assert_eq!(
                        node.busy_cpus() as usize,
                        busy.iter().filter(|&&b| b).count()
                    );
                }
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
        let a = c.nodes.get("a").unwrap().cpu_topo().clone();
        assert!(Arc::ptr_eq(&a, c.nodes.get("b").unwrap().cpu_topo()));
        // The honest nodes' tree survived every eviction.
        register_node(&mut c, "d", "2s:4c:2t", ("z", "r4"), 999, &mut fx);
        assert!(Arc::ptr_eq(&a, c.nodes.get("d").unwrap().cpu_topo()));
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
