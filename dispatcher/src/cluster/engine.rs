//! The node-level engine: one [`Sched`] whose leaves are the nodes
//! (capacity = CPU slots; SMT level = host group, LLC level = rack, NUMA
//! level = zone, package level = region), the order of its leaves, and
//! its rebuild when the node set changes.
//!
//! Invariants: leaf `i` is node `order()[i]`, the nodes sorted by
//! (region, zone, rack, host group, name); observers (metrics, the web
//! page, the simulator) read that order here and never sort again. While
//! `dirty` (nodes registered since the last build) the leaves are stale
//! and [`NodeEngine::leaf`] answers None.

use std::collections::HashMap;
use std::sync::Arc;

use proto::v1::JobSpec;
use sched::topology::{DomainFlags, TopologyBuilder};
use sched::{FreeSummary, LeafId, LeafSet, Sched, SchedConfig, SchedEvent, TaskId};

use super::jobs::{NodeName, Unplaced};
use super::nodes::{NameIndex, NodeInfo, NodeSlot, Nodes};
use crate::spec::align_of;

/// The engine's clock: nanoseconds (the dispatcher's is milliseconds), so
/// `avg_idle` and the steal cost compare in one unit.
pub fn engine_ns(now_ms: i64) -> u64 {
    (now_ms.max(0) as u64).saturating_mul(1_000_000)
}

/// `NodeEngine::slot_leaf`'s mark of a slot without a leaf.
const NO_LEAF: u32 = u32::MAX;

/// A node's shape as placement filters it ([`NodeInfo::shape`]).
type NodeShape = (FreeSummary, u64, u32);

/// The node-level engine and its leaf order.
pub struct NodeEngine {
    config: SchedConfig,
    sched: Option<Sched>,
    dirty: bool,
    /// Leaf -> node name, and back (the leaves hashed by their names in
    /// `leaf_node`: no second copy of each name).
    leaf_node: Vec<NodeName>,
    node_leaf: NameIndex,
    /// Leaf -> the node's registry slot, and back (by slot number;
    /// [`NO_LEAF`] for a node registered since the build): the start and
    /// the finish reach the node and its leaf without hashing its name.
    leaf_slot: Vec<NodeSlot>,
    slot_leaf: Vec<u32>,
    /// Per leaf: its entry in `shapes` (a cluster's nodes come in a few
    /// shapes: 4 bytes per node rather than the 40 of the shape itself).
    leaf_shape: Vec<u32>,
    /// The distinct shapes of the leaves' nodes: the largest aligned room
    /// of the whole (empty) node, its memory (u64::MAX when unknown) and
    /// its GPUs.
    shapes: Vec<NodeShape>,
    /// The smallest of each over all leaves.
    leaf_shape_min: (FreeSummary, u64),
    /// Steals made by engines that rebuilds replaced, so that `steals`
    /// never goes backwards (the core takes differences of it).
    steals_before: u64,
    /// The buffer events are drained into, kept between drains
    /// ([`NodeEngine::take_event_buf`]).
    event_buf: Vec<SchedEvent>,
    /// Bumped by every rebuild and mark_dirty ([`NodeEngine::builds`]).
    builds: u64,
}

impl NodeEngine {
    /// No engine until nodes register.
    pub fn new(config: SchedConfig) -> Self {
        Self {
            config,
            sched: None,
            dirty: false,
            leaf_node: Vec::new(),
            node_leaf: NameIndex::default(),
            leaf_slot: Vec::new(),
            slot_leaf: Vec::new(),
            leaf_shape: Vec::new(),
            shapes: Vec::new(),
            leaf_shape_min: (FreeSummary::default(), 0),
            steals_before: 0,
            event_buf: Vec::new(),
            builds: 0,
        }
    }

    /// The events buffer, to drain into ([`Sched::drain_events_into`]);
    /// give it back with [`NodeEngine::put_event_buf`] so the next drain
    /// allocates nothing (a nested drain meanwhile gets an empty one).
    pub(super) fn take_event_buf(&mut self) -> Vec<SchedEvent> {
        std::mem::take(&mut self.event_buf)
    }

    /// Keep `buf` for the next drain.
    pub(super) fn put_event_buf(&mut self, buf: Vec<SchedEvent>) {
        self.event_buf = buf;
    }

    /// A counter bumped by every rebuild (and [`NodeEngine::mark_dirty`]):
    /// the leaf order, the node shapes and the engine's tree change only
    /// then (the engine's queues change without it).
    pub fn builds(&self) -> u64 {
        self.builds
    }

    /// The engine (None until a node registers).
    pub fn sched(&self) -> Option<&Sched> {
        self.sched.as_ref()
    }

    /// The engine, to drive.
    pub fn sched_mut(&mut self) -> Option<&mut Sched> {
        self.sched.as_mut()
    }

    /// Node names by leaf (empty while stale).
    pub fn order(&self) -> &[NodeName] {
        if self.dirty { &[] } else { &self.leaf_node }
    }

    /// Node names by leaf, as built (stale or not).
    pub(super) fn built_order(&self) -> &[NodeName] {
        &self.leaf_node
    }

    /// The node's leaf (None while stale or for an unknown node).
    pub fn leaf(&self, node: &str) -> Option<LeafId> {
        if self.dirty {
            return None;
        }
        self.node_leaf.get(node, |l| &self.leaf_node[l])
    }

    /// The node's leaf in the engine as built, stale or not.
    pub(super) fn built_leaf(&self, node: &str) -> Option<LeafId> {
        self.node_leaf.get(node, |l| &self.leaf_node[l])
    }

    /// Push node `n`'s modelled free summary into the engine, at its leaf
    /// `leaf` ([`super::Cluster::sync_summary`] for a caller that holds
    /// both already).
    pub(super) fn report_summary(&mut self, leaf: LeafId, n: &NodeInfo, now: i64) {
        let summary = n.engine_room();
        if let Some(engine) = self.sched_mut() {
            let _ = engine.set_free_summary(leaf, summary, engine_ns(now));
        }
    }

    /// The node of a leaf.
    pub fn node_at(&self, leaf: LeafId) -> Option<&str> {
        self.leaf_node.get(leaf).map(NodeName::as_str)
    }

    /// The node of a leaf, its name shared (a copy is a count).
    pub fn name_at(&self, leaf: LeafId) -> Option<&NodeName> {
        self.leaf_node.get(leaf)
    }

    /// The engine, to drive, with the registry slots of its leaves' nodes
    /// ([`NodeEngine::slot_at`]), borrowed together.
    pub(super) fn sched_and_slots(&mut self) -> Option<(&mut Sched, &[NodeSlot])> {
        let slots = &self.leaf_slot;
        self.sched.as_mut().map(|s| (s, slots.as_slice()))
    }

    /// The registry slot of a leaf's node ([`NodeEngine::node_at`]'s
    /// node).
    pub(super) fn slot_at(&self, leaf: LeafId) -> Option<NodeSlot> {
        self.leaf_slot.get(leaf).copied()
    }

    /// [`NodeEngine::built_leaf`] of the node in `slot`.
    pub(super) fn built_leaf_at(&self, slot: NodeSlot) -> Option<LeafId> {
        match self.slot_leaf.get(slot.index()) {
            Some(&l) if l != NO_LEAF => Some(l as LeafId),
            _ => None,
        }
    }

    /// Each node of the engine with its largest aligned room, memory and
    /// GPUs, as placement filters them (for the pending reasons), in leaf
    /// order.
    pub(super) fn shapes(&self) -> impl Iterator<Item = (&str, &NodeShape)> + '_ {
        self.leaf_node
            .iter()
            .map(NodeName::as_str)
            .zip(self.leaf_shape.iter().map(|&s| &self.shapes[s as usize]))
    }

    /// Steals made so far, over every engine this one has rebuilt
    /// (monotonic).
    pub fn steals(&self) -> u64 {
        self.steals_before + self.sched.as_ref().map_or(0, |e| e.stats().steal)
    }

    /// The node set changed: rebuild before the next use.
    pub fn mark_dirty(&mut self) {
        self.builds += 1;
        self.dirty = true;
    }

    /// True while the leaves are stale.
    pub fn is_dirty(&self) -> bool {
        self.dirty
    }

    /// Clear the stale mark; true when it was set (the caller rebuilds).
    pub(super) fn take_dirty(&mut self) -> bool {
        std::mem::take(&mut self.dirty)
    }

    /// Set the cost of a steal (ns).
    pub fn set_steal_cost(&mut self, ns: u64) {
        self.config.steal_cost = ns;
        if let Some(engine) = self.sched.as_mut() {
            let mut c = engine.config().clone();
            c.steal_cost = ns;
            engine.set_config(c);
        }
    }

    /// Build an empty engine over the current node set (None without
    /// nodes; the old engine stays if the tree cannot be built). Returns
    /// true when an engine was built.
    pub(super) fn rebuild(&mut self, nodes: &Nodes) -> bool {
        self.builds += 1;
        if nodes.is_empty() {
            self.steals_before = self.steals();
            self.sched = None;
            self.leaf_node.clear();
            self.node_leaf.clear();
            self.leaf_slot.clear();
            self.slot_leaf.clear();
            return false;
        }
        let mut slotted: Vec<(NodeSlot, &NodeInfo)> = nodes.iter_slots().collect();
        slotted.sort_by(|a, b| a.1.order_key().cmp(&b.1.order_key()));
        let (slots, order): (Vec<NodeSlot>, Vec<&NodeInfo>) = slotted.into_iter().unzip();
        // A level's key of a node: equal keys, one group (the builder
        // numbers groups by their first leaf, not by key). The keys are
        // interned from the places' and names' strings, borrowed: a
        // rebuild allocates nothing per node for them.
        fn key<K: std::hash::Hash + Eq>(intern: &mut HashMap<K, u64>, k: K) -> u64 {
            let next = intern.len() as u64;
            *intern.entry(k).or_insert(next)
        }
        let n = order.len();
        let (mut rack, mut zone, mut region) = (
            Vec::with_capacity(n),
            Vec::with_capacity(n),
            Vec::with_capacity(n),
        );
        let (mut racks, mut zones, mut regions) = (HashMap::new(), HashMap::new(), HashMap::new());
        for x in &order {
            let (xregion, xzone, xrack) = (x.region(), x.zone(), x.rack());
            rack.push(key(&mut racks, (xregion, xzone, xrack)));
            zone.push(key(&mut zones, (xregion, xzone)));
            region.push(key(&mut regions, xregion));
        }
        // Host groups only when some node has one (the level is left out
        // otherwise); a node without one is a group of its own.
        let has_hostgroups = order.iter().any(|x| !x.hostgroup().is_empty());
        let hg: Vec<u64> = if has_hostgroups {
            let mut hgs = HashMap::new();
            order
                .iter()
                .map(|x| {
                    // (place, own group?, the host group's or the node's name)
                    let own = x.hostgroup().is_empty();
                    let name = if own { x.name.as_str() } else { x.hostgroup() };
                    key(&mut hgs, (x.region(), x.zone(), x.rack(), own, name))
                })
                .collect()
        } else {
            Vec::new()
        };
        let mut b = TopologyBuilder::new((0..n as u64).collect());
        if has_hostgroups {
            b = b.level("hostgroup", DomainFlags::SMT, hg);
        }
        let topo = match b
            .level("rack", DomainFlags::LLC, rack)
            .level("zone", DomainFlags::NUMA, zone)
            .level("region", DomainFlags::PACKAGE, region)
            .build()
        {
            Ok(t) => Arc::new(t),
            Err(err) => {
                tracing::error!(%err, "cannot build the cluster topology");
                return false;
            }
        };
        // The old engine goes before the new one is built, so the new one
        // reuses its freed blocks rather than spreading over fresh
        // allocator pages that the old one's blocks then leave partly
        // empty and resident (a registration burst rebuilds ~150 times:
        // docs/BENCHMARKS.md, section "mem3").
        self.steals_before = self.steals();
        self.sched = None;
        self.leaf_node = order.iter().map(|x| x.name.clone()).collect();
        self.node_leaf = NameIndex::of(&self.leaf_node);
        self.leaf_slot = slots;
        let slot_end = self.leaf_slot.iter().map(|s| s.index() + 1).max();
        self.slot_leaf = vec![NO_LEAF; slot_end.unwrap_or(0)];
        for (leaf, s) in self.leaf_slot.iter().enumerate() {
            self.slot_leaf[s.index()] = leaf as u32;
        }
        let mut shape_of: HashMap<NodeShape, u32> = HashMap::new();
        self.shapes.clear();
        self.leaf_shape = order
            .iter()
            .map(|n| {
                let shape = n.shape();
                *shape_of.entry(shape).or_insert_with(|| {
                    self.shapes.push(shape);
                    (self.shapes.len() - 1) as u32
                })
            })
            .collect();
        drop(shape_of);
        let mut min = (
            FreeSummary {
                core: u32::MAX,
                llc: u32::MAX,
                numa: u32::MAX,
                package: u32::MAX,
                any: u32::MAX,
            },
            u64::MAX,
        );
        for (f, m, _) in &self.shapes {
            min.0 = FreeSummary {
                core: min.0.core.min(f.core),
                llc: min.0.llc.min(f.llc),
                numa: min.0.numa.min(f.numa),
                package: min.0.package.min(f.package),
                any: min.0.any.min(f.any),
            };
            min.1 = min.1.min(*m);
        }
        self.leaf_shape_min = min;
        let caps: Vec<u32> = order.iter().map(|n| n.slots()).collect();
        self.sched = Some(Sched::with_capacities(topo, &caps, self.config.clone()));
        true
    }

    /// Nodes a spec may run on, as engine leaves (None: all of them);
    /// `Err` when none: `NoMatch` when no node has the labels, CPUs,
    /// memory and GPUs at all, `GpusBusy` when some have the GPUs but
    /// none has `spec.gpus` free now (`gpus_free(node)`: the node's GPUs
    /// not taken by other jobs).
    pub(super) fn allowed_leaves(
        &self,
        spec: &JobSpec,
        nodes: &Nodes,
        gpus_free: impl Fn(&str) -> u32,
    ) -> Result<Option<Arc<LeafSet>>, Unplaced> {
        let align = align_of(spec);
        // Fast path: no selector, no GPUs and every node is big enough.
        if spec.node_selector.is_empty()
            && spec.gpus == 0
            && spec.cpus <= self.leaf_shape_min.0.get(align)
            && (spec.memory_bytes == 0 || spec.memory_bytes <= self.leaf_shape_min.1)
        {
            return Ok(None);
        }
        let mut all = true;
        let mut leaves = Vec::new();
        let mut busy = false;
        for (leaf, name) in self.leaf_node.iter().enumerate() {
            let Some(n) = nodes.get(name) else {
                all = false;
                continue;
            };
            let (largest, memory, gpus) = self.shapes[self.leaf_shape[leaf] as usize];
            let fits_labels = spec.node_selector.iter().all(|(k, v)| n.labels.has(k, v));
            let fits_mem = spec.memory_bytes == 0 || memory >= spec.memory_bytes;
            let fits_cpus = largest.get(align) >= spec.cpus;
            let fits_gpus = gpus >= spec.gpus;
            // Free GPUs are a filter, like the labels: the engine's
            // capacity counts CPUs only.
            let free_gpus = spec.gpus == 0 || gpus_free(name) >= spec.gpus;
            if fits_labels && fits_mem && fits_cpus && fits_gpus && free_gpus {
                leaves.push(leaf);
            } else {
                busy |= fits_labels && fits_mem && fits_cpus && fits_gpus;
                all = false;
            }
        }
        if leaves.is_empty() && busy {
            return Err(Unplaced::GpusBusy { gpus: spec.gpus });
        }
        if leaves.is_empty() {
            return Err(Unplaced::NoMatch {
                selector: Arc::new(
                    spec.node_selector
                        .iter()
                        .map(|(k, v)| (k.clone(), v.clone()))
                        .collect(),
                ),
                cpus: spec.cpus,
                align,
                memory_bytes: spec.memory_bytes,
                gpus: spec.gpus,
            });
        }
        if all {
            Ok(None)
        } else {
            Ok(Some(Arc::new(LeafSet::from_leaves(
                self.leaf_node.len(),
                leaves,
            ))))
        }
    }

    /// Open a deferral of the engine's aggregate refreshes
    /// ([`Sched::defer_aggregates`]) for one cluster operation; pass the
    /// result to [`NodeEngine::settle_aggregates`] when it ends. A placement
    /// and the room report of its start then refresh the node's leaf and
    /// the domains above it once.
    pub(super) fn defer_aggregates(&mut self) -> bool {
        self.sched.as_mut().is_none_or(Sched::defer_aggregates)
    }

    /// End the deferral [`NodeEngine::defer_aggregates`] opened.
    pub(super) fn settle_aggregates(&mut self, outer: bool) {
        if let Some(engine) = self.sched.as_mut() {
            engine.settle_aggregates(outer);
        }
    }

    /// A finished job's task leaves the engine: its waker history lives
    /// in the cluster's `wakers` records, which outlive tasks and rebuilds.
    pub(super) fn retire(&mut self, task: TaskId, now: i64) {
        self.remove(task, now);
    }

    /// [`NodeEngine::retire`] of a task that held room on `leaf`, with
    /// the leaf's room after its release (`summary`, as
    /// [`Sched::set_free_summary`] takes it) set in the same engine
    /// operation ([`Sched::remove_task_freeing`]). True when the engine
    /// had the task and took the room; false when the caller must still
    /// push the room.
    pub(super) fn retire_freeing(
        &mut self,
        task: TaskId,
        leaf: LeafId,
        summary: Option<FreeSummary>,
        now: i64,
    ) -> bool {
        // No `task(task)` check first (a lookup, and a copy of the task
        // when a tick is pending): `remove_task_freeing` refuses an
        // unknown task (or leaf) before it changes anything.
        self.sched.as_mut().is_some_and(|engine| {
            engine
                .remove_task_freeing(task, leaf, summary, engine_ns(now))
                .is_ok()
        })
    }

    /// Remove a task if the engine has it.
    pub(super) fn remove(&mut self, task: TaskId, now: i64) {
        if let Some(engine) = self.sched.as_mut()
            && engine.has_task(task)
        {
            let _ = engine.remove_task(task, engine_ns(now));
        }
    }
}

impl super::Cluster {
    /// Rebuild the engine if the node set changed since the last build.
    pub(super) fn ensure_engine(&mut self, now: i64, fx: &mut super::Effects) {
        if self.engine.take_dirty() {
            self.rebuild_engine(now, fx);
        }
    }

    /// Build the node-level engine for the current node set and put every
    /// job back into it: jobs on nodes first (they hold capacity), then
    /// queued ones, then the unplaced ones (a new node may match them).
    fn rebuild_engine(&mut self, now: i64, fx: &mut super::Effects) {
        if !self.engine.rebuild(&self.nodes) {
            return;
        }
        // The reservation's leaves are stale: the gang pass below takes it
        // again.
        self.gangs.drop_reservation();
        let mut on_nodes = Vec::new();
        for node in self.engine.order().to_vec() {
            for key in self.jobs.on(&node, NodeSlot::of(&node)) {
                if let Some(e) = self.jobs.get(key)
                    && e.phase().on_node().is_some()
                {
                    on_nodes.push((key, node.clone()));
                }
            }
        }
        on_nodes.sort();
        for (key, node) in on_nodes {
            let (Some(e), Some(leaf)) = (self.jobs.get(key), self.engine.built_leaf(&node)) else {
                continue;
            };
            let tspec = super::lifecycle::task_spec(e, None, self.predicted_ns(e));
            let task = e.task;
            if let Some(engine) = self.engine.sched_mut()
                && engine.add_task(tspec).is_ok()
            {
                let _ = engine.wake_up_on(task, leaf, engine_ns(now));
            }
        }
        // Started events of jobs already on nodes are ignored by on_started.
        self.process_events(now, fx);
        for name in self.engine.order().to_vec() {
            let cap = self.effective_capacity(&name);
            if let (Some(leaf), Some(engine)) =
                (self.engine.built_leaf(&name), self.engine.sched_mut())
            {
                let _ = engine.set_capacity(leaf, cap, engine_ns(now));
            }
            self.sync_summary(&name, now);
        }
        for key in self.jobs.queued() {
            self.place(key, now, fx);
        }
        for key in self.jobs.unplaced() {
            self.place(key, now, fx);
        }
        self.process_events(now, fx);
        self.schedule_gangs(now, fx);
    }

    /// Push a node's modelled free summary into the engine.
    pub(super) fn sync_summary(&mut self, name: &str, now: i64) {
        let (Some(n), Some(leaf)) = (self.nodes.get(name), self.engine.built_leaf(name)) else {
            return;
        };
        self.engine.report_summary(leaf, n, now);
    }

    /// The node's capacity as the engine should see it: its CPUs when it
    /// takes new jobs, else just what its jobs hold (so nothing new fits
    /// and nothing running is disturbed).
    pub(super) fn effective_capacity(&self, name: &str) -> u32 {
        match self.nodes.get(name) {
            None => 0,
            Some(n) if n.schedulable() => n.slots(),
            Some(n) => self.jobs.cpus_held(name, NodeSlot::of(&n.name)),
        }
    }

    /// Set a node's engine capacity to [`Self::effective_capacity`]; jobs
    /// queued on a node that takes no new jobs are placed again.
    pub(super) fn refresh_capacity(&mut self, name: &str, now: i64, fx: &mut super::Effects) {
        self.shrink_capacity(name, now);
        let Some(leaf) = self.engine.built_leaf(name) else {
            return;
        };
        if !self.nodes.get(name).is_some_and(NodeInfo::schedulable) {
            let queued: Vec<TaskId> = self
                .engine
                .sched()
                .map_or(Vec::new(), |e| e.rq(leaf).waiting().collect());
            for task in queued {
                if let Some(key) = self.jobs.of_task(task) {
                    if let Some(engine) = self.engine.sched_mut() {
                        let _ = engine.block(task, engine_ns(now));
                    }
                    self.place(key, now, fx);
                }
            }
        }
        self.process_events(now, fx);
    }

    /// Set a node's engine capacity to [`Self::effective_capacity`] and
    /// nothing else.
    pub(super) fn shrink_capacity(&mut self, name: &str, now: i64) {
        let cap = self.effective_capacity(name);
        if let (Some(leaf), Some(engine)) = (self.engine.built_leaf(name), self.engine.sched_mut())
        {
            let _ = engine.set_capacity(leaf, cap, engine_ns(now));
        }
    }
}
