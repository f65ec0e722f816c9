//! The topology tree: scheduling domains over leaves, built from per-leaf
//! attributes, with the kernel's per-leaf shortcuts.
//!
//! A *leaf* is what a task runs on: a logical CPU in the agent, a node in the
//! dispatcher. Callers describe each leaf by one group key per level,
//! innermost level first (CPU: core, LLC, NUMA node, package; cluster: host
//! group, rack, zone, region). The builder turns that into a tree:
//!
//! * **Nesting is enforced.** A leaf's group at level `l` is the set of leaves
//!   that share its keys at `l` *and at every outer level*. An LLC that is
//!   larger than a NUMA node (Intel sub-NUMA clustering) is therefore split per
//!   NUMA node, which is what the kernel's x86 topology code does when it sees
//!   an LLC spanning nodes ("not on the same node! Ignoring dependency").
//! * **Degenerate levels are dropped** (seed 002, "build topology
//!   dynamically"): a domain with a single child is removed and its flags are
//!   merged into the child, so a machine whose LLC is its package gets one
//!   domain flagged `LLC | NUMA | PACKAGE`, not three identical ones.
//! * **Spans need not be contiguous** in leaf ids: x86 numbers SMT siblings
//!   `c` and `c + ncores`, big.LITTLE has LLCs {0,3,4,5} and {1,2}. Every span
//!   is a range of [`Topology::order`], a depth-first order of the leaves.
//!
//! Per-leaf shortcuts mirror the kernel's `sd_llc`, `sd_llc_size`,
//! `sd_llc_id` and `cpu_smt_mask` (seed 001 patch 2, seed 000 patch 2).
//! The tree is immutable: a change of hardware (hotplug, a node joining)
//! builds a new one, as scx_utils does.

use std::collections::HashMap;
use std::fmt;
use std::ops::{BitOr, BitOrAssign, Range};
use std::sync::Arc;

use thiserror::Error;

/// Dense index of a leaf, `0..nr_leaves`.
pub type LeafId = usize;
/// Index of a tree node. Leaves are nodes `0..nr_leaves`; domains follow.
pub type NodeId = usize;

/// What a domain's leaves share. Several flags survive on one domain when
/// degenerate levels are merged.
#[derive(Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct DomainFlags(u8);

impl DomainFlags {
    /// No sharing property (a plain grouping level, or the root).
    pub const NONE: Self = Self(0);
    /// Hardware threads of one core (cluster: nodes of one host group).
    pub const SMT: Self = Self(1);
    /// Leaves sharing a last-level cache (cluster: a rack). Overload masks
    /// and `sd_llc` live at this level.
    pub const LLC: Self = Self(2);
    /// A NUMA node (cluster: a zone). Counted for node-limit gating.
    pub const NUMA: Self = Self(4);
    /// A package / socket (cluster: a region).
    pub const PACKAGE: Self = Self(8);

    /// True when every flag of `other` is set in `self`.
    pub fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0 && other.0 != 0
    }
}

impl BitOr for DomainFlags {
    type Output = Self;
    fn bitor(self, rhs: Self) -> Self {
        Self(self.0 | rhs.0)
    }
}

impl BitOrAssign for DomainFlags {
    fn bitor_assign(&mut self, rhs: Self) {
        self.0 |= rhs.0;
    }
}

impl fmt::Debug for DomainFlags {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut names = Vec::new();
        for (flag, name) in [
            (Self::SMT, "SMT"),
            (Self::LLC, "LLC"),
            (Self::NUMA, "NUMA"),
            (Self::PACKAGE, "PACKAGE"),
        ] {
            if self.contains(flag) {
                names.push(name);
            }
        }
        if names.is_empty() {
            write!(f, "NONE")
        } else {
            write!(f, "{}", names.join("|"))
        }
    }
}

/// Errors from building a topology. These come from outside input (sysfs,
/// node labels, a spec string), so they are values, never panics.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum TopologyError {
    /// A topology needs at least one leaf.
    #[error("topology has no leaves")]
    NoLeaves,
    /// A level gave a key count different from the number of leaves.
    #[error("level {level:?} has {got} keys for {expected} leaves")]
    KeyCount {
        /// The level's name.
        level: String,
        /// Number of leaves.
        expected: usize,
        /// Number of keys given.
        got: usize,
    },
    /// A level's groups do not partition the leaves.
    #[error("level {level:?}: {reason}")]
    BadGroups {
        /// The level's name.
        level: String,
        /// What is wrong.
        reason: String,
    },
    /// More tree nodes than `u32` indexes (2^32 - 1), or more levels than
    /// a node's `u16` level.
    #[error("topology too large: {nodes} tree nodes, {levels} levels")]
    TooLarge {
        /// Number of tree nodes.
        nodes: usize,
        /// Number of levels of the description.
        levels: usize,
    },
    /// A topology spec string could not be parsed.
    #[error("bad topology spec {spec:?}: {reason}")]
    BadSpec {
        /// The spec as given.
        spec: String,
        /// What is wrong with it.
        reason: String,
    },
}

/// One level of the description: a name, what it shares, and a group key per
/// leaf. Leaves with equal keys (and equal keys at every outer level) form
/// one domain.
#[derive(Clone, Debug)]
pub struct LevelSpec {
    /// Name shown in dumps ("SMT", "LLC", "NUMA", "PKG", "rack", "zone").
    pub name: String,
    /// What the leaves of one group share.
    pub flags: DomainFlags,
    /// Group key of each leaf, indexed by [`LeafId`].
    pub keys: Vec<u64>,
}

/// Collects levels and builds a [`Topology`].
#[derive(Clone, Debug)]
pub struct TopologyBuilder {
    os_ids: Vec<u64>,
    levels: Vec<LevelSpec>,
}

impl TopologyBuilder {
    /// A builder for leaves whose outside ids (CPU number, node index) are
    /// `os_ids`; dense leaf `i` is `os_ids[i]`.
    pub fn new(os_ids: Vec<u64>) -> Self {
        Self {
            os_ids,
            levels: Vec::new(),
        }
    }

    /// Add the next level, innermost first.
    pub fn level(mut self, name: &str, flags: DomainFlags, keys: Vec<u64>) -> Self {
        self.levels.push(LevelSpec {
            name: name.to_string(),
            flags,
            keys,
        });
        self
    }

    /// Add a level given as groups of outside ids (e.g. the CPU lists an
    /// agent reports: SMT sibling lists, LLC lists, ...). Every leaf must be
    /// in exactly one group.
    pub fn level_from_groups(
        self,
        name: &str,
        flags: DomainFlags,
        groups: &[Vec<u64>],
    ) -> Result<Self, TopologyError> {
        let bad = |reason: String| TopologyError::BadGroups {
            level: name.to_string(),
            reason,
        };
        let index: HashMap<u64, usize> = self
            .os_ids
            .iter()
            .enumerate()
            .map(|(i, &id)| (id, i))
            .collect();
        let mut keys = vec![u64::MAX; self.os_ids.len()];
        for (g, group) in groups.iter().enumerate() {
            for id in group {
                let leaf = *index
                    .get(id)
                    .ok_or_else(|| bad(format!("id {id} is not a leaf")))?;
                if keys[leaf] != u64::MAX {
                    return Err(bad(format!("id {id} is in two groups")));
                }
                keys[leaf] = g as u64;
            }
        }
        if let Some(leaf) = keys.iter().position(|&k| k == u64::MAX) {
            return Err(bad(format!("id {} is in no group", self.os_ids[leaf])));
        }
        Ok(self.level(name, flags, keys))
    }

    /// Build the tree; see the module documentation for the rules.
    pub fn build(self) -> Result<Topology, TopologyError> {
        Topology::build(self.os_ids, self.levels)
    }
}

/// A node of the tree: a leaf (no children) or a domain, in 24 bytes (a
/// cluster has one per node): its parent, span and children as `u32`
/// indexes, the children a range of the topology's one child list
/// ([`Topology::children`]) rather than a vector each (a 24-byte header
/// on every leaf).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Domain {
    /// The enclosing domain; [`NO_PARENT`] for the root.
    parent: u32,
    /// The leaves below, as a range of [`Topology::order`].
    span: [u32; 2],
    /// The child nodes, as a range of the topology's child list.
    children: [u32; 2],
    /// Index of the level that made this domain (0 = leaf, `l + 1` = level
    /// `l` of the description, `nr_levels + 1` = the root).
    level: u16,
    /// What the leaves share (merged when degenerate levels were dropped).
    flags: DomainFlags,
}

/// [`Domain`]'s parent of the root.
const NO_PARENT: u32 = u32::MAX;

impl Domain {
    /// The enclosing domain; `None` for the root.
    #[inline]
    pub fn parent(&self) -> Option<NodeId> {
        (self.parent != NO_PARENT).then_some(self.parent as NodeId)
    }

    /// The leaves below, as a range of [`Topology::order`].
    #[inline]
    pub fn span(&self) -> Range<usize> {
        self.span[0] as usize..self.span[1] as usize
    }

    /// What the leaves share (merged when degenerate levels were dropped).
    #[inline]
    pub fn flags(&self) -> DomainFlags {
        self.flags
    }

    /// Index of the level that made this domain (0 = leaf, `l + 1` = level
    /// `l` of the description, `nr_levels + 1` = the root).
    #[inline]
    pub fn level(&self) -> u32 {
        u32::from(self.level)
    }

    /// Number of child nodes (0 for a leaf).
    #[inline]
    pub fn nr_children(&self) -> usize {
        (self.children[1] - self.children[0]) as usize
    }

    /// A leaf: no children.
    #[inline]
    pub fn is_leaf(&self) -> bool {
        self.children[0] == self.children[1]
    }
}

/// A node while the tree is built: [`Domain`]'s fields with a vector of
/// children, packed into [`Domain`]s at the end of [`Topology::build`].
#[derive(Clone, Debug)]
struct BuildNode {
    parent: Option<NodeId>,
    children: Vec<NodeId>,
    span: Range<usize>,
    flags: DomainFlags,
    level: u32,
}

/// A last-level-cache group (cluster: a rack).
#[derive(Clone, Debug)]
pub struct Llc {
    /// The leaves sharing it, ascending by leaf id.
    pub members: LeafRun,
    /// The tree node whose span is exactly this group.
    pub node: NodeId,
}

/// The immutable scheduling-domain tree and its per-leaf shortcuts.
#[derive(Clone, Debug)]
pub struct Topology {
    /// The leaves' outside ids; empty when leaf `i`'s id is `i` (the
    /// dispatcher numbers its nodes so: 8 bytes per node saved).
    os_ids: Vec<u64>,
    nr_leaves: usize,
    level_names: Vec<String>,
    nodes: Vec<Domain>,
    /// Every domain's children, domain after domain (`Domain::children`
    /// is a range of it).
    children: Vec<NodeId>,
    /// Shared with the leaf groups whose members, group after group, are
    /// the same sequence ([`LeafGroups::sharing`]).
    order: Arc<[LeafId]>,
    root: NodeId,
    /// `cores.get(c)` = leaves of core `c`, ascending; cores are numbered
    /// by their lowest leaf id, so core 0 is the highest packing priority.
    cores: LeafGroups,
    /// Per leaf, its core, LLC, position in the LLC and NUMA node, in
    /// `u32` (a topology has fewer than 2^32 leaves; the per-leaf tables
    /// of a 10,000-node cluster are its size in KB); `core_of` empty when
    /// every core is one leaf (core `l` is then leaf `l`).
    core_of: Vec<u32>,
    llcs: Vec<Llc>,
    llc_of: Vec<u32>,
    llc_pos: Vec<u32>,
    numa_of: Vec<u32>,
    nr_numa: usize,
    /// Leaves of each NUMA node, ascending, ranked by lowest leaf.
    numa_groups: LeafGroups,
    /// Leaves of each package, ascending, ranked by lowest leaf.
    package_groups: LeafGroups,
    /// Per domain with LLC children: the indexes of those LLCs (the
    /// seed's proposed per-domain list of LLC masks).
    sibling_lists: Vec<Vec<usize>>,
    /// For each LLC, its parent domain's entry in `sibling_lists`.
    llc_sibling_list: Vec<usize>,
    /// Cores and alignment groups as bit masks, for a machine of at most
    /// 64 leaves (the allocator's word scan); `None` above that.
    leaf_masks: Option<Box<crate::alloc::LeafMasks>>,
}

impl Topology {
    fn build(os_ids: Vec<u64>, levels: Vec<LevelSpec>) -> Result<Self, TopologyError> {
        let n = os_ids.len();
        if n == 0 {
            return Err(TopologyError::NoLeaves);
        }
        for level in &levels {
            if level.keys.len() != n {
                return Err(TopologyError::KeyCount {
                    level: level.name.clone(),
                    expected: n,
                    got: level.keys.len(),
                });
            }
        }
        let nr_levels = levels.len();

        // Group ids per level, from the outside in, so that groups nest.
        // gid[l][leaf]; level nr_levels is the root (one group).
        let mut gid = vec![vec![0usize; n]; nr_levels + 1];
        let mut ngroups = vec![0usize; nr_levels + 1];
        ngroups[nr_levels] = 1;
        for l in (0..nr_levels).rev() {
            let mut intern: HashMap<(usize, u64), usize> = HashMap::new();
            // Intern in leaf-id order so group numbering follows lowest leaf.
            let (inner, outer) = gid.split_at_mut(l + 1);
            for ((g, &parent), &key) in inner[l].iter_mut().zip(&outer[0]).zip(&levels[l].keys) {
                let next = intern.len();
                *g = *intern.entry((parent, key)).or_insert(next);
            }
            ngroups[l] = intern.len();
        }

        // Shortcut groups, from the undegenerated description: a singleton
        // LLC or core is still an LLC or core of size 1.
        let highest_with = |flag: DomainFlags| -> Option<usize> {
            (0..nr_levels)
                .rev()
                .find(|&l| levels[l].flags.contains(flag))
        };
        let lowest_with = |flag: DomainFlags| -> Option<usize> {
            (0..nr_levels).find(|&l| levels[l].flags.contains(flag))
        };
        let groups_of = |l: Option<usize>| -> (Vec<usize>, usize) {
            match l {
                Some(l) => (gid[l].clone(), ngroups[l]),
                None => ((0..n).collect(), n),
            }
        };
        let (core_gid, _) = groups_of(lowest_with(DomainFlags::SMT));
        let (llc_gid, nr_llc) = groups_of(highest_with(DomainFlags::LLC));
        let (numa_gid, nr_numa) = match highest_with(DomainFlags::NUMA) {
            Some(l) => (gid[l].clone(), ngroups[l]),
            None => (vec![0; n], 1),
        };

        // Tree nodes: leaves first, then every (level, group), then the root.
        let mut nodes: Vec<BuildNode> = (0..n)
            .map(|_| BuildNode {
                parent: None,
                children: Vec::new(),
                span: 0..0,
                flags: DomainFlags::NONE,
                level: 0,
            })
            .collect();
        let mut base = vec![0usize; nr_levels + 1];
        for l in 0..=nr_levels {
            base[l] = nodes.len();
            for _ in 0..ngroups[l] {
                nodes.push(BuildNode {
                    parent: None,
                    children: Vec::new(),
                    span: 0..0,
                    flags: if l < nr_levels {
                        levels[l].flags
                    } else {
                        DomainFlags::NONE
                    },
                    level: l as u32 + 1,
                });
            }
        }
        let root = base[nr_levels];
        for leaf in 0..n {
            let mut child = leaf;
            for (b, g) in base.iter().zip(&gid) {
                let node = b + g[leaf];
                if nodes[child].parent.is_none() {
                    nodes[child].parent = Some(node);
                    nodes[node].children.push(child);
                }
                child = node;
            }
        }

        // Drop degenerate domains: one child means the same span.
        let mut alive = vec![true; nodes.len()];
        for id in n..nodes.len() {
            if nodes[id].children.len() != 1 {
                continue;
            }
            let child = nodes[id].children[0];
            let parent = nodes[id].parent;
            let flags = nodes[id].flags;
            if child >= n {
                // Keep the lower domain, as the kernel does, with both flags.
                nodes[child].flags |= flags;
            }
            if parent.is_none() && child < n {
                // A one-leaf machine: keep a root domain over the leaf.
                continue;
            }
            nodes[child].parent = parent;
            if let Some(p) = parent {
                for c in nodes[p].children.iter_mut() {
                    if *c == id {
                        *c = child;
                    }
                }
            }
            alive[id] = false;
        }
        let root = if alive[root] {
            root
        } else {
            // The root collapsed into its only child: that child is the root.
            let mut r = 0;
            while let Some(p) = nodes[r].parent {
                r = p;
            }
            r
        };

        // Compact: renumber surviving domains after the leaves.
        let mut remap = vec![usize::MAX; nodes.len()];
        let mut compact = Vec::with_capacity(nodes.len());
        for (id, node) in nodes.iter_mut().enumerate() {
            if alive[id] {
                remap[id] = compact.len();
                compact.push(BuildNode {
                    children: std::mem::take(&mut node.children),
                    ..node.clone()
                });
            }
        }
        for node in compact.iter_mut() {
            node.parent = node.parent.map(|p| remap[p]);
            for c in node.children.iter_mut() {
                *c = remap[*c];
            }
            node.children.sort_by_key(|&c| c);
        }
        let root = remap[root];
        drop(remap);
        // The uncompacted nodes (64 bytes each, their children taken) go
        // before the tree is walked: the build's peak holds one copy.
        drop(nodes);
        drop(alive);
        let mut nodes = compact;

        // Depth-first order of leaves; children visited in order of their
        // lowest leaf, so spans follow leaf numbering where they can.
        let mut min_leaf = vec![usize::MAX; nodes.len()];
        for leaf in 0..n {
            let mut id = Some(leaf);
            while let Some(x) = id {
                if min_leaf[x] <= leaf {
                    break;
                }
                min_leaf[x] = leaf;
                id = nodes[x].parent;
            }
        }
        for node in nodes.iter_mut() {
            node.children.sort_by_key(|&c| min_leaf[c]);
        }
        let mut order = Vec::with_capacity(n);
        assign_spans(&mut nodes, root, &mut order);

        // Cores, ranked by lowest leaf id.
        let (mut core_of, nr_cores) = rank_of(&core_gid);
        let cores = LeafGroups::of(&core_of, nr_cores);
        if nr_cores == n {
            // A core per leaf, ranked by lowest leaf: core `l` is leaf `l`.
            core_of = Vec::new();
        }
        let (llc_members, llc_of) = rank_groups(&llc_gid);
        debug_assert_eq!(llc_members.len(), nr_llc);
        let mut llc_pos = vec![0; n];
        for members in &llc_members {
            for (pos, &leaf) in members.iter().enumerate() {
                llc_pos[leaf] = pos as u32;
            }
        }
        let llc_nodes: Vec<NodeId> = llc_members
            .iter()
            .map(|members| {
                let size = members.len();
                let mut node = members[0];
                while nodes[node].span.len() < size {
                    match nodes[node].parent {
                        Some(p) => node = p,
                        None => break,
                    }
                }
                node
            })
            .collect();
        let (numa_of, nr_numa_groups) = rank_of(&numa_gid);
        let numa_groups = LeafGroups::of(&numa_of, nr_numa_groups);
        let pkg_gid = match highest_with(DomainFlags::PACKAGE) {
            Some(l) => gid[l].clone(),
            None => vec![0; n],
        };
        let (pkg_of, nr_packages) = rank_of(&pkg_gid);
        let package_groups = LeafGroups::of(&pkg_of, nr_packages);

        // Per-LLC sibling list: the LLCs under the parent of this LLC's node,
        // computed once per parent and shared by its LLCs. Fix (found by
        // fuzz/fuzz_targets/topo_spec.rs timing out on "509s:8c"): it was
        // computed per LLC with a linear `contains` per leaf, O(LLCs^2 x
        // leaves): 16 s for a cluster of 2000 racks.
        let mut sibling_lists: Vec<Vec<usize>> = Vec::new();
        let mut list_of_parent: HashMap<Option<NodeId>, usize> = HashMap::new();
        let mut llc_sibling_list = Vec::with_capacity(llc_nodes.len());
        let mut seen = vec![false; llc_nodes.len()];
        for (i, &llc_node) in llc_nodes.iter().enumerate() {
            let parent = nodes[llc_node].parent;
            let list = match parent {
                // Only a root LLC has no parent: it is its own list.
                None => {
                    sibling_lists.push(vec![i]);
                    sibling_lists.len() - 1
                }
                Some(p) => *list_of_parent.entry(parent).or_insert_with(|| {
                    let mut members = Vec::new();
                    for &leaf in &order[nodes[p].span.clone()] {
                        let l = llc_of[leaf] as usize;
                        if !seen[l] {
                            seen[l] = true;
                            members.push(l);
                        }
                    }
                    for &l in &members {
                        seen[l] = false;
                    }
                    members.sort_unstable();
                    sibling_lists.push(members);
                    sibling_lists.len() - 1
                }),
            };
            llc_sibling_list.push(list);
        }

        // Pack the nodes: `u32` indexes, the children in one list.
        let too_large = || TopologyError::TooLarge {
            nodes: nodes.len(),
            levels: nr_levels,
        };
        if nodes.len() >= NO_PARENT as usize {
            return Err(too_large());
        }
        let mut children = Vec::with_capacity(nodes.len() - 1);
        let mut packed = Vec::with_capacity(nodes.len());
        for node in &nodes {
            let first = children.len() as u32;
            children.extend_from_slice(&node.children);
            packed.push(Domain {
                parent: node.parent.map_or(NO_PARENT, |p| p as u32),
                span: [node.span.start as u32, node.span.end as u32],
                children: [first, children.len() as u32],
                level: u16::try_from(node.level).map_err(|_| too_large())?,
                flags: node.flags,
            });
        }
        drop(nodes);

        let identity = os_ids.iter().enumerate().all(|(i, &id)| id == i as u64);
        // One vector for the depth-first order and every grouping that
        // lists the same leaves in the same order (a cluster's, whose
        // leaves are sorted by place: 8 bytes per node each).
        let order: Arc<[LeafId]> = order.into();
        let cores = cores.sharing(&order);
        let numa_groups = numa_groups.sharing(&order);
        let package_groups = package_groups.sharing(&order);
        let llc_leaves: Vec<LeafId> = llc_members.iter().flatten().copied().collect();
        let llc_leaves: Arc<[LeafId]> = if llc_leaves[..] == order[..] {
            Arc::clone(&order)
        } else {
            llc_leaves.into()
        };
        let mut at = 0;
        let llcs = llc_members
            .iter()
            .zip(llc_nodes)
            .map(|(members, node)| {
                let start = at;
                at += members.len() as u32;
                Llc {
                    members: LeafRun {
                        all: Arc::clone(&llc_leaves),
                        start,
                        end: at,
                    },
                    node,
                }
            })
            .collect();
        drop(llc_members);
        let mut topo = Self {
            os_ids: if identity { Vec::new() } else { os_ids },
            nr_leaves: n,
            level_names: levels.into_iter().map(|l| l.name).collect(),
            nodes: packed,
            children,
            order,
            root,
            cores,
            core_of,
            llcs,
            llc_of,
            llc_pos,
            numa_of,
            nr_numa,
            numa_groups,
            package_groups,
            sibling_lists,
            llc_sibling_list,
            leaf_masks: None,
        };
        topo.leaf_masks = crate::alloc::LeafMasks::of(&topo).map(Box::new);
        Ok(topo)
    }

    /// The cores and alignment groups as bit masks (at most 64 leaves).
    pub fn leaf_masks(&self) -> Option<&crate::alloc::LeafMasks> {
        self.leaf_masks.as_deref()
    }

    /// Number of leaves.
    pub fn nr_leaves(&self) -> usize {
        self.nr_leaves
    }

    /// The outside id of a leaf (CPU number, node index).
    pub fn os_id(&self, leaf: LeafId) -> u64 {
        if self.os_ids.is_empty() {
            assert!(leaf < self.nr_leaves, "leaf {leaf} out of range");
            leaf as u64
        } else {
            self.os_ids[leaf]
        }
    }

    /// The dense id of the leaf with outside id `os_id`.
    pub fn leaf_of_os_id(&self, os_id: u64) -> Option<LeafId> {
        if self.os_ids.is_empty() {
            usize::try_from(os_id).ok().filter(|&l| l < self.nr_leaves)
        } else {
            self.os_ids.iter().position(|&x| x == os_id)
        }
    }

    /// All tree nodes; leaves are `0..nr_leaves`.
    pub fn nodes(&self) -> &[Domain] {
        &self.nodes
    }

    /// One tree node.
    pub fn node(&self, id: NodeId) -> &Domain {
        &self.nodes[id]
    }

    /// The root domain.
    pub fn root(&self) -> NodeId {
        self.root
    }

    /// Leaves in depth-first order; every span is a range of it.
    pub fn order(&self) -> &[LeafId] {
        &self.order
    }

    /// The leaves of a node's span.
    pub fn span(&self, node: NodeId) -> &[LeafId] {
        &self.order[self.nodes[node].span()]
    }

    /// A node's children (empty for a leaf), in order of their lowest leaf.
    #[inline]
    pub fn children(&self, node: NodeId) -> &[NodeId] {
        let [a, b] = self.nodes[node].children;
        &self.children[a as usize..b as usize]
    }

    /// A node's enclosing domain; `None` for the root.
    #[inline]
    pub fn parent(&self, node: NodeId) -> Option<NodeId> {
        self.nodes[node].parent()
    }

    /// Name of a node's level ("leaf", a level name, or "root").
    pub fn level_name(&self, node: NodeId) -> &str {
        let level = self.nodes[node].level as usize;
        if level == 0 {
            "leaf"
        } else if level <= self.level_names.len() {
            &self.level_names[level - 1]
        } else {
            "root"
        }
    }

    /// The domains enclosing a leaf, innermost first, ending at the root.
    pub fn ancestors(&self, leaf: LeafId) -> Ancestors<'_> {
        Ancestors {
            topo: self,
            next: self.nodes[leaf].parent(),
        }
    }

    /// The SMT siblings of a leaf, itself included (`cpu_smt_mask`).
    pub fn smt_siblings(&self, leaf: LeafId) -> &[LeafId] {
        self.cores.get(self.core_of(leaf))
    }

    /// The core of a leaf; core numbers rank cores by their lowest leaf id.
    pub fn core_of(&self, leaf: LeafId) -> usize {
        if self.core_of.is_empty() {
            assert!(leaf < self.nr_leaves, "leaf {leaf} out of range");
            leaf
        } else {
            self.core_of[leaf] as usize
        }
    }

    /// All cores, each a list of leaves.
    pub fn cores(&self) -> &LeafGroups {
        &self.cores
    }

    /// The LLC group of a leaf (index into [`Topology::llcs`]).
    pub fn llc_of(&self, leaf: LeafId) -> usize {
        self.llc_of[leaf] as usize
    }

    /// The leaf's position within its LLC's member list: its element number
    /// in that LLC's overload mask.
    pub fn llc_pos(&self, leaf: LeafId) -> usize {
        self.llc_pos[leaf] as usize
    }

    /// All LLC groups.
    pub fn llcs(&self) -> &[Llc] {
        &self.llcs
    }

    /// The tree node of the leaf's LLC (`sd_llc`; the leaf itself when its
    /// LLC is a singleton).
    pub fn sd_llc(&self, leaf: LeafId) -> NodeId {
        self.llcs[self.llc_of[leaf] as usize].node
    }

    /// Number of leaves sharing the leaf's LLC (`sd_llc_size`, the wake_wide
    /// factor of seed 001 patch 2).
    pub fn sd_llc_size(&self, leaf: LeafId) -> usize {
        self.llcs[self.llc_of[leaf] as usize].members.len()
    }

    /// The lowest leaf of the leaf's LLC (`sd_llc_id`).
    pub fn sd_llc_id(&self, leaf: LeafId) -> LeafId {
        self.llcs[self.llc_of[leaf] as usize].members[0]
    }

    /// True when two leaves share an LLC (`cpus_share_cache`).
    pub fn share_llc(&self, a: LeafId, b: LeafId) -> bool {
        self.llc_of[a] == self.llc_of[b]
    }

    /// The NUMA node (cluster: zone) of a leaf, ranked by lowest leaf id.
    pub fn numa_of(&self, leaf: LeafId) -> usize {
        self.numa_of[leaf] as usize
    }

    /// Number of NUMA nodes (cluster: zones).
    pub fn nr_numa(&self) -> usize {
        self.nr_numa
    }

    /// Leaves of each NUMA node (cluster: zone).
    pub fn numa_groups(&self) -> &LeafGroups {
        &self.numa_groups
    }

    /// Leaves of each package (cluster: region); the whole topology when
    /// no level is flagged PACKAGE.
    pub fn package_groups(&self) -> &LeafGroups {
        &self.package_groups
    }

    /// Number of distinct NUMA nodes under a tree node.
    ///
    /// A mark per NUMA node (its rank, `numa_of`), not a vector of the
    /// span's leaves: a cluster's zone spans thousands of nodes, and that
    /// vector (20 KB for 2,500) was allocated by every rebuild, in the
    /// allocator's medium pages, which the relays' frames then kept
    /// resident around the blocks still in use.
    pub fn numa_span(&self, node: NodeId) -> usize {
        let mut seen = vec![false; self.numa_groups.len()];
        let mut count = 0;
        for &l in self.span(node) {
            let g = &mut seen[self.numa_of[l] as usize];
            count += usize::from(!*g);
            *g = true;
        }
        count
    }

    /// The LLCs under the parent domain of this LLC, this one included: the
    /// per-domain list of LLC masks proposed in seed 000 for stealing across
    /// LLCs.
    pub fn llc_siblings(&self, llc: usize) -> &[usize] {
        &self.sibling_lists[self.llc_sibling_list[llc]]
    }

    /// Build a test or demo topology from a short spec; see [`TopoSpec`].
    pub fn from_spec(spec: &str) -> Result<Self, TopologyError> {
        TopoSpec::parse(spec)?.build()
    }
}

/// Iterator over a leaf's enclosing domains, innermost first.
pub struct Ancestors<'a> {
    topo: &'a Topology,
    next: Option<NodeId>,
}

impl Iterator for Ancestors<'_> {
    type Item = NodeId;
    fn next(&mut self) -> Option<NodeId> {
        let id = self.next?;
        self.next = self.topo.nodes[id].parent();
        Some(id)
    }
}

fn assign_spans(nodes: &mut [BuildNode], root: NodeId, order: &mut Vec<LeafId>) {
    // Iterative DFS: (node, next child index, span start).
    let mut stack: Vec<(NodeId, usize, usize)> = vec![(root, 0, order.len())];
    while let Some(top) = stack.last_mut() {
        let (id, idx, start) = *top;
        if nodes[id].children.is_empty() {
            order.push(id);
            nodes[id].span = start..order.len();
            stack.pop();
            continue;
        }
        if idx < nodes[id].children.len() {
            top.1 += 1;
            let child = nodes[id].children[idx];
            stack.push((child, 0, order.len()));
        } else {
            nodes[id].span = start..order.len();
            stack.pop();
        }
    }
}

/// Renumber group ids by lowest member; return members per group and the
/// new group of each leaf.
fn rank_groups(gid: &[usize]) -> (Vec<Vec<LeafId>>, Vec<u32>) {
    let (of, count) = rank_of(gid);
    let mut groups: Vec<Vec<LeafId>> = vec![Vec::new(); count];
    for (leaf, &r) in of.iter().enumerate() {
        groups[r as usize].push(leaf);
    }
    // The groups live as long as the topology: give back the growth's
    // spare room (a group of one leaf pushed once holds room for four).
    for g in &mut groups {
        g.shrink_to_fit();
    }
    (groups, of)
}

/// Per leaf, the rank of its group id `gid[leaf]` (groups ranked by
/// their lowest leaf), and the number of groups.
fn rank_of(gid: &[usize]) -> (Vec<u32>, usize) {
    let mut rank: HashMap<usize, u32> = HashMap::new();
    let of = gid
        .iter()
        .map(|&g| {
            let next = rank.len() as u32;
            *rank.entry(g).or_insert(next)
        })
        .collect();
    (of, rank.len())
}

/// A run of leaves in a vector shared with other runs: an LLC's members,
/// a range of the leaves of every LLC, LLC after LLC, which is the
/// topology's order when the LLCs list the leaves in that order (a
/// cluster's racks: no vector per rack, no 8 bytes per node). Reads as a
/// slice.
#[derive(Clone)]
pub struct LeafRun {
    all: Arc<[LeafId]>,
    start: u32,
    end: u32,
}

impl LeafRun {
    /// The leaves.
    #[inline]
    pub fn as_slice(&self) -> &[LeafId] {
        &self.all[self.start as usize..self.end as usize]
    }
}

impl std::ops::Deref for LeafRun {
    type Target = [LeafId];

    #[inline]
    fn deref(&self) -> &[LeafId] {
        self.as_slice()
    }
}

impl<'a> IntoIterator for &'a LeafRun {
    type Item = &'a LeafId;
    type IntoIter = std::slice::Iter<'a, LeafId>;

    #[inline]
    fn into_iter(self) -> Self::IntoIter {
        self.as_slice().iter()
    }
}

impl PartialEq for LeafRun {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl Eq for LeafRun {}

impl PartialEq<[LeafId]> for LeafRun {
    fn eq(&self, other: &[LeafId]) -> bool {
        self.as_slice() == other
    }
}

impl PartialEq<Vec<LeafId>> for LeafRun {
    fn eq(&self, other: &Vec<LeafId>) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl fmt::Debug for LeafRun {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.as_slice()).finish()
    }
}

/// A partition of the leaves into groups, each ascending, ranked by
/// lowest leaf, held in one vector: a cluster's cores are a group per
/// node, and a vector each cost ~40 bytes per node where this costs 12.
#[derive(Clone, Debug)]
pub struct LeafGroups {
    /// The groups' leaves, group after group (shared with the topology's
    /// order when the same, [`LeafGroups::sharing`]).
    members: Arc<[LeafId]>,
    /// Where each group ends in `members`; empty when every group is one
    /// leaf (a cluster's cores without host groups: 4 bytes per node).
    ends: Vec<u32>,
    /// Number of groups.
    len: usize,
}

impl LeafGroups {
    /// The groups of `of` (per leaf, its group's rank, `< count`).
    fn of(of: &[u32], count: usize) -> Self {
        let mut ends = vec![0u32; count];
        for &r in of {
            ends[r as usize] += 1;
        }
        let mut at = 0;
        for e in &mut ends {
            at += *e;
            *e = at;
        }
        // Fill each group from its end backwards, leaves in descending
        // order: each group comes out ascending.
        let mut next = ends.clone();
        let mut members = vec![0; of.len()];
        for (leaf, &r) in of.iter().enumerate().rev() {
            next[r as usize] -= 1;
            members[next[r as usize] as usize] = leaf;
        }
        let len = ends.len();
        Self {
            members: members.into(),
            ends: if len == of.len() { Vec::new() } else { ends },
            len,
        }
    }

    /// The same groups, their members held by `order` when they are the
    /// same sequence.
    fn sharing(mut self, order: &Arc<[LeafId]>) -> Self {
        if self.members == *order {
            self.members = Arc::clone(order);
        }
        self
    }

    /// Number of groups.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when there is no group.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Group `i`'s leaves, ascending.
    #[inline]
    pub fn get(&self, i: usize) -> &[LeafId] {
        if self.ends.is_empty() {
            assert!(i < self.len, "group {i} of {}", self.len);
            return std::slice::from_ref(&self.members[i]);
        }
        let start = if i == 0 { 0 } else { self.ends[i - 1] as usize };
        &self.members[start..self.ends[i] as usize]
    }

    /// The groups in rank order.
    pub fn iter(&self) -> LeafGroupsIter<'_> {
        LeafGroupsIter {
            groups: self,
            next: 0,
        }
    }
}

impl<'a> IntoIterator for &'a LeafGroups {
    type Item = &'a [LeafId];
    type IntoIter = LeafGroupsIter<'a>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

/// The iterator of [`LeafGroups::iter`].
#[derive(Clone, Debug)]
pub struct LeafGroupsIter<'a> {
    groups: &'a LeafGroups,
    next: usize,
}

impl<'a> Iterator for LeafGroupsIter<'a> {
    type Item = &'a [LeafId];

    #[inline]
    fn next(&mut self) -> Option<&'a [LeafId]> {
        if self.next == self.groups.len() {
            return None;
        }
        self.next += 1;
        Some(self.groups.get(self.next - 1))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        let left = self.groups.len() - self.next;
        (left, Some(left))
    }
}

impl ExactSizeIterator for LeafGroupsIter<'_> {}

/// One CPU of a machine [`TopoSpec`], as [`TopoSpec::machine_cpus`] numbers it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpecCpu {
    /// Core, counted across sockets.
    pub core: usize,
    /// Hardware thread within the core.
    pub thread: usize,
    /// Core within its socket.
    pub core_in_socket: usize,
    /// Socket (package).
    pub socket: usize,
    /// LLC, counted across sockets.
    pub llc: usize,
    /// NUMA node, counted across sockets.
    pub numa: usize,
    /// The CPUs of this CPU's core (itself included), ascending.
    pub smt_siblings: Vec<usize>,
}

/// A short description of a test or demo topology.
///
/// * Machines: `S s:C c:T t` with options, e.g. `2s:22c:2t` (seed 000's
///   88-CPU X6-2), `1s:10c:2t`, `6s:16c:8t:linear` (POWER10 SMT8).
///   Options: `llc=N` (cores per LLC; default the whole socket),
///   `numa=N` (NUMA nodes per socket; default 1), `linear` (number CPUs core
///   by core, as POWER does; the default numbers them as x86 Linux does:
///   first thread of every core, then the second threads).
/// * Clusters: `Z z:R r:N n` with an optional `H h` (nodes per host group),
///   e.g. `2z:4r:8n`: 2 zones of 4 racks of 8 nodes; leaves are nodes
///   numbered zone by zone, rack by rack.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TopoSpec {
    /// A machine of CPUs.
    Machine {
        /// Sockets (packages).
        sockets: usize,
        /// Cores per socket.
        cores: usize,
        /// Hardware threads per core.
        threads: usize,
        /// Cores per LLC (`None`: one LLC per socket).
        cores_per_llc: Option<usize>,
        /// NUMA nodes per socket.
        numa_per_socket: usize,
        /// Number CPUs core by core instead of x86-style.
        linear: bool,
    },
    /// A cluster of nodes.
    Cluster {
        /// Zones.
        zones: usize,
        /// Racks per zone.
        racks: usize,
        /// Nodes per rack.
        nodes: usize,
        /// Nodes per host group (`None`: no host-group level).
        hostgroup: Option<usize>,
    },
}

impl TopoSpec {
    /// The most leaves a spec may describe (a test machine or cluster, not
    /// a typo that allocates terabytes).
    pub const MAX_LEAVES: usize = 1 << 20;

    /// Number of leaves (CPUs or nodes) the spec describes; `None` when the
    /// product overflows.
    pub fn nr_leaves(&self) -> Option<usize> {
        match *self {
            TopoSpec::Machine {
                sockets,
                cores,
                threads,
                ..
            } => sockets.checked_mul(cores)?.checked_mul(threads),
            TopoSpec::Cluster {
                zones,
                racks,
                nodes,
                ..
            } => zones.checked_mul(racks)?.checked_mul(nodes),
        }
    }

    /// Parse a spec string (see the type's documentation).
    pub fn parse(spec: &str) -> Result<Self, TopologyError> {
        let parsed = Self::parse_fields(spec)?;
        // Fix (found while writing fuzz/fuzz_targets/topo_spec.rs): a product of
        // counts overflowed in `build` (a panic) or asked for terabytes.
        match parsed.nr_leaves() {
            Some(n) if n <= Self::MAX_LEAVES => Ok(parsed),
            _ => Err(TopologyError::BadSpec {
                spec: spec.to_string(),
                reason: format!("more than {} leaves", Self::MAX_LEAVES),
            }),
        }
    }

    fn parse_fields(spec: &str) -> Result<Self, TopologyError> {
        let bad = |reason: &str| TopologyError::BadSpec {
            spec: spec.to_string(),
            reason: reason.to_string(),
        };
        let mut counts: HashMap<char, usize> = HashMap::new();
        let mut opts: HashMap<String, usize> = HashMap::new();
        let mut linear = false;
        for part in spec.split(':').map(str::trim) {
            if part.is_empty() {
                return Err(bad("empty field"));
            }
            if part == "linear" {
                linear = true;
            } else if let Some((k, v)) = part.split_once('=') {
                let v: usize = v
                    .parse()
                    .map_err(|_| bad(&format!("{k}= wants a number")))?;
                opts.insert(k.to_string(), v);
            } else {
                let unit = part.chars().last().ok_or_else(|| bad("empty field"))?;
                let num: usize = part[..part.len() - unit.len_utf8()]
                    .parse()
                    .map_err(|_| bad(&format!("{part:?} is not <number><unit>")))?;
                if counts.insert(unit, num).is_some() {
                    return Err(bad(&format!("unit {unit} given twice")));
                }
            }
        }
        for (&unit, &num) in &counts {
            if num == 0 {
                return Err(bad(&format!("count for {unit} must be > 0")));
            }
        }
        for (k, &v) in &opts {
            if v == 0 {
                return Err(bad(&format!("{k} must be > 0")));
            }
        }
        if counts.contains_key(&'s') {
            for k in opts.keys() {
                if k != "llc" && k != "numa" {
                    return Err(bad(&format!("unknown option {k}")));
                }
            }
            let get = |u: char| counts.get(&u).copied();
            for u in counts.keys() {
                if !matches!(u, 's' | 'c' | 't') {
                    return Err(bad(&format!("unknown unit {u} in a machine spec")));
                }
            }
            let cores = get('c').ok_or_else(|| bad("missing <N>c (cores per socket)"))?;
            let numa = opts.get("numa").copied().unwrap_or(1);
            if cores % numa != 0 {
                return Err(bad("cores per socket must divide evenly into numa nodes"));
            }
            Ok(TopoSpec::Machine {
                sockets: get('s').unwrap_or(1),
                cores,
                threads: get('t').unwrap_or(1),
                cores_per_llc: opts.get("llc").copied(),
                numa_per_socket: numa,
                linear,
            })
        } else if counts.contains_key(&'z') || counts.contains_key(&'n') {
            for u in counts.keys() {
                if !matches!(u, 'z' | 'r' | 'n' | 'h') {
                    return Err(bad(&format!("unknown unit {u} in a cluster spec")));
                }
            }
            if !opts.is_empty() || linear {
                return Err(bad("cluster specs take no options"));
            }
            Ok(TopoSpec::Cluster {
                zones: counts.get(&'z').copied().unwrap_or(1),
                racks: counts.get(&'r').copied().unwrap_or(1),
                nodes: counts
                    .get(&'n')
                    .copied()
                    .ok_or_else(|| bad("missing <N>n"))?,
                hostgroup: counts.get(&'h').copied(),
            })
        } else {
            Err(bad("want <S>s:<C>c:<T>t or <Z>z:<R>r:<N>n"))
        }
    }

    /// The CPUs of a machine spec in leaf order (CPU `i` is leaf `i`), with
    /// the ids the engine numbers them by: the one place that decides how a
    /// spec's CPUs map to cores, LLCs, NUMA nodes and sockets, so that
    /// synthetic machines (the agent's `--topology`) and the engine's tree
    /// agree. `None` for a cluster spec.
    pub fn machine_cpus(&self) -> Option<Vec<SpecCpu>> {
        let TopoSpec::Machine {
            sockets,
            cores,
            threads,
            cores_per_llc,
            numa_per_socket,
            linear,
        } = *self
        else {
            return None;
        };
        let ncores = sockets * cores;
        let n = ncores * threads;
        let cpu_of = |core: usize, thread: usize| {
            if linear {
                core * threads + thread
            } else {
                thread * ncores + core
            }
        };
        Some(
            (0..n)
                .map(|cpu| {
                    let (core, thread) = if linear {
                        (cpu / threads, cpu % threads)
                    } else {
                        (cpu % ncores, cpu / ncores)
                    };
                    let socket = core / cores;
                    let core_in_socket = core % cores;
                    let llc = match cores_per_llc {
                        Some(k) => socket * cores.div_ceil(k) + core_in_socket / k,
                        None => socket,
                    };
                    let numa =
                        socket * numa_per_socket + core_in_socket / (cores / numa_per_socket);
                    SpecCpu {
                        core,
                        thread,
                        core_in_socket,
                        socket,
                        llc,
                        numa,
                        smt_siblings: (0..threads).map(|t| cpu_of(core, t)).collect(),
                    }
                })
                .collect(),
        )
    }

    /// Build the topology this spec describes.
    pub fn build(&self) -> Result<Topology, TopologyError> {
        match *self {
            TopoSpec::Machine { .. } => {
                let spec_cpus = self.machine_cpus().unwrap_or_default();
                let os_ids = (0..spec_cpus.len() as u64).collect();
                let key = |f: fn(&SpecCpu) -> usize| -> Vec<u64> {
                    spec_cpus.iter().map(|c| f(c) as u64).collect()
                };
                let (core_k, llc_k, numa_k, pkg_k) = (
                    key(|c| c.core),
                    key(|c| c.llc),
                    key(|c| c.numa),
                    key(|c| c.socket),
                );
                TopologyBuilder::new(os_ids)
                    .level("SMT", DomainFlags::SMT, core_k)
                    .level("LLC", DomainFlags::LLC, llc_k)
                    .level("NUMA", DomainFlags::NUMA, numa_k)
                    .level("PKG", DomainFlags::PACKAGE, pkg_k)
                    .build()
            }
            TopoSpec::Cluster {
                zones,
                racks,
                nodes,
                hostgroup,
            } => {
                let n = zones * racks * nodes;
                let os_ids: Vec<u64> = (0..n as u64).collect();
                let rack: Vec<u64> = (0..n).map(|i| (i / nodes) as u64).collect();
                let zone: Vec<u64> = (0..n).map(|i| (i / (nodes * racks)) as u64).collect();
                let mut b = TopologyBuilder::new(os_ids);
                if let Some(h) = hostgroup {
                    let hg: Vec<u64> = (0..n)
                        .map(|i| ((i / nodes) * nodes.div_ceil(h) + (i % nodes) / h) as u64)
                        .collect();
                    b = b.level("hostgroup", DomainFlags::SMT, hg);
                }
                b.level("rack", DomainFlags::LLC, rack)
                    .level("zone", DomainFlags::NUMA, zone)
                    .build()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sorted(mut v: Vec<usize>) -> Vec<usize> {
        v.sort_unstable();
        v
    }

    /// Every node's span is the union of its children's; spans nest.
    fn check_tree(t: &Topology) {
        let mut seen = vec![0; t.nr_leaves()];
        for &l in t.span(t.root()) {
            seen[l] += 1;
        }
        assert!(seen.iter().all(|&c| c == 1), "root spans every leaf once");
        for (id, node) in t.nodes().iter().enumerate() {
            if node.is_leaf() {
                assert!(id < t.nr_leaves());
                assert_eq!(t.span(id), &[id]);
                continue;
            }
            assert!(
                node.nr_children() >= 2 || id == t.root(),
                "node {id} is degenerate"
            );
            let mut union: Vec<usize> = t
                .children(id)
                .iter()
                .flat_map(|&c| t.span(c).to_vec())
                .collect();
            union.sort_unstable();
            assert_eq!(union, sorted(t.span(id).to_vec()));
            for &c in t.children(id) {
                assert_eq!(t.node(c).parent(), Some(id));
            }
        }
        // Brute force over the packed nodes: a node's span is the leaves
        // whose parent chain passes through it, its children the nodes
        // whose parent it is (ordered by lowest leaf), its accessors agree.
        let nodes = t.nodes().len();
        let mut under = vec![Vec::new(); nodes];
        for leaf in 0..t.nr_leaves() {
            let mut x = Some(leaf);
            while let Some(id) = x {
                under[id].push(leaf);
                x = t.parent(id);
            }
        }
        for id in 0..nodes {
            let node = t.node(id);
            assert_eq!(sorted(t.span(id).to_vec()), under[id], "span of {id}");
            assert_eq!(node.span().len(), under[id].len());
            let mut kids: Vec<usize> = (0..nodes).filter(|&c| t.parent(c) == Some(id)).collect();
            kids.sort_by_key(|&c| under[c][0]);
            assert_eq!(t.children(id), &kids[..], "children of {id}");
            assert_eq!(node.nr_children(), kids.len());
            assert_eq!(node.is_leaf(), kids.is_empty());
            assert_eq!(node.is_leaf(), id < t.nr_leaves());
            assert_eq!(node.parent().is_none(), id == t.root());
            if id < t.nr_leaves() {
                assert_eq!(node.level(), 0);
            } else {
                assert!(node.level() > 0);
            }
        }
    }

    /// Cores, NUMA nodes and packages: partitions of the leaves, each
    /// group ascending, ranked by lowest leaf, each leaf in the group its
    /// `*_of` names; their members share the order's vector exactly when
    /// they are the same sequence.
    fn check_groups(t: &Topology) {
        let n = t.nr_leaves();
        let of: [&dyn Fn(usize) -> usize; 2] = [&|l| t.core_of(l), &|l| t.numa_of(l)];
        for (i, groups) in [t.cores(), t.numa_groups(), t.package_groups()]
            .into_iter()
            .enumerate()
        {
            let all: Vec<usize> = groups.iter().flatten().copied().collect();
            assert_eq!(sorted(all.clone()), (0..n).collect::<Vec<_>>());
            assert!(groups.iter().all(|g| g.windows(2).all(|w| w[0] < w[1])));
            let firsts: Vec<usize> = groups.iter().map(|g| g[0]).collect();
            assert_eq!(firsts.len(), groups.len());
            assert_eq!(groups.ends.is_empty(), groups.len() == n);
            assert_eq!(groups.is_empty(), groups.iter().next().is_none());
            assert!(firsts.windows(2).all(|w| w[0] < w[1]));
            assert_eq!(
                Arc::ptr_eq(&groups.members, &t.order),
                all[..] == t.order[..]
            );
            if let Some(of) = of.get(i) {
                for l in 0..n {
                    assert!(groups.get(of(l)).contains(&l));
                }
            }
        }
        assert_eq!(t.numa_groups().len(), t.nr_numa());
        // LLCs: each the leaves whose LLC it is, ascending, ranked by
        // lowest leaf; all in one vector, the order's when the same.
        let llc_leaves: Vec<usize> = t.llcs().iter().flat_map(|l| l.members.to_vec()).collect();
        for (i, llc) in t.llcs().iter().enumerate() {
            let want: Vec<usize> = (0..n).filter(|&l| t.llc_of(l) == i).collect();
            assert_eq!(llc.members.as_slice(), &want[..]);
            assert_eq!(&llc.members, &llc.members.clone());
            assert_eq!((&llc.members).into_iter().count(), want.len());
            assert_eq!(
                Arc::ptr_eq(&llc.members.all, &t.order),
                llc_leaves[..] == t.order[..]
            );
        }
        assert_eq!(t.core_of.is_empty(), t.cores().len() == n);
        for l in 0..n {
            assert!(t.smt_siblings(l).contains(&l));
        }
        // Every node's NUMA span against its leaves' NUMA ids, sorted and
        // deduplicated (the vector `numa_span` no longer builds).
        for id in 0..t.nodes().len() {
            let ids: Vec<usize> = t.span(id).iter().map(|&l| t.numa_of(l)).collect();
            let mut distinct = sorted(ids);
            distinct.dedup();
            assert_eq!(t.numa_span(id), distinct.len(), "node {id}");
        }
    }

    /// The node record stays packed: a cluster has one per node.
    #[test]
    fn a_tree_node_is_24_bytes() {
        assert_eq!(std::mem::size_of::<Domain>(), 24);
    }

    /// Regression (found while writing fuzz/fuzz_targets/topo_spec.rs): counts whose
    /// product overflows panicked in `build`; huge ones allocated without
    /// bound.
    #[test]
    fn specs_with_too_many_leaves_are_refused() {
        for spec in [
            "99999999999s:99999999999c:99999999999t",
            "18446744073709551615z:2r:2n",
            "1048577n",
            "1024s:1024c:2t",
        ] {
            let e = TopoSpec::parse(spec).unwrap_err();
            assert!(
                e.to_string().contains("more than 1048576 leaves"),
                "{spec}: {e}"
            );
        }
        assert_eq!(
            TopoSpec::parse("1048576n").unwrap().nr_leaves(),
            Some(1 << 20)
        );
        assert_eq!(TopoSpec::parse("2s:22c:2t").unwrap().nr_leaves(), Some(88));
    }

    /// Regression (found by fuzz/fuzz_targets/topo_spec.rs: "509s:8c"
    /// timed out): many LLCs under one parent built in O(LLCs^2 x leaves).
    /// Counted, not timed: 2000 racks share one list of 2000 siblings.
    #[test]
    fn many_llcs_share_one_sibling_list() {
        let t = Topology::from_spec("1z:2000r:8n").unwrap();
        assert_eq!(t.llcs().len(), 2000);
        let first = t.llc_siblings(0);
        assert_eq!(first.len(), 2000);
        assert!(first.windows(2).all(|w| w[0] < w[1]));
        assert!((0..2000).all(|l| std::ptr::eq(t.llc_siblings(l), first)));
    }

    #[test]
    fn x6_2_one_socket() {
        let t = Topology::from_spec("1s:10c:2t").unwrap();
        check_tree(&t);
        check_groups(&t);
        assert_eq!(t.nr_leaves(), 20);
        // x86 numbering: siblings are c and c + 10.
        assert_eq!(t.smt_siblings(3), &[3, 13]);
        assert_eq!(t.sd_llc_size(0), 20);
        assert_eq!(t.sd_llc_id(17), 0);
        // One socket: LLC = NUMA = package = machine, all merged in the root.
        let root = t.root();
        assert_eq!(t.sd_llc(5), root);
        assert!(
            t.node(root)
                .flags()
                .contains(DomainFlags::LLC | DomainFlags::NUMA)
        );
        assert_eq!(t.children(root).len(), 10, "10 cores below the LLC");
        assert_eq!(t.nr_numa(), 1);
    }

    #[test]
    fn x6_2_two_sockets_88_cpus() {
        let t = Topology::from_spec("2s:22c:2t").unwrap();
        check_tree(&t);
        check_groups(&t);
        assert_eq!(t.nr_leaves(), 88);
        assert_eq!(t.smt_siblings(0), &[0, 44]);
        assert_eq!(t.smt_siblings(22), &[22, 66]);
        assert_eq!(t.sd_llc_size(0), 44);
        assert!(t.share_llc(0, 21) && t.share_llc(0, 65) && !t.share_llc(0, 22));
        assert_eq!(t.nr_numa(), 2);
        assert_eq!(t.children(t.root()).len(), 2);
        let llc = t.node(t.sd_llc(0));
        assert!(
            llc.flags()
                .contains(DomainFlags::LLC | DomainFlags::NUMA | DomainFlags::PACKAGE)
        );
        assert_eq!(t.llc_siblings(t.llc_of(0)), &[0, 1]);
    }

    #[test]
    fn power10_smt8_linear_with_sparse_numa_keys() {
        // Seed 002's POWER10: SMT8, NUMA node ids 0,1,4,5 interleaved every
        // 8 CPUs; each core its own LLC (L2 shared by a thread group).
        let n = 320;
        let os: Vec<u64> = (0..n).collect();
        let core: Vec<u64> = (0..n).map(|c| c / 8).collect();
        let numa_ids = [0u64, 1, 4, 5];
        let numa: Vec<u64> = (0..n).map(|c| numa_ids[((c / 8) % 4) as usize]).collect();
        let t = TopologyBuilder::new(os)
            .level("SMT", DomainFlags::SMT, core.clone())
            .level("LLC", DomainFlags::LLC, core)
            .level("NUMA", DomainFlags::NUMA, numa)
            .build()
            .unwrap();
        check_tree(&t);
        check_groups(&t);
        assert_eq!(t.nr_numa(), 4);
        assert_eq!(t.smt_siblings(9), &[8, 9, 10, 11, 12, 13, 14, 15]);
        assert_eq!(t.sd_llc_size(9), 8);
        // SMT == LLC span: one domain with both flags.
        let d = t.node(t.sd_llc(9));
        assert!(d.flags().contains(DomainFlags::SMT | DomainFlags::LLC));
        // NUMA node of CPU 8 holds CPUs 8-15, 40-47, ...: not contiguous.
        let numa_node = t.node(t.sd_llc(9)).parent().unwrap();
        let span = sorted(t.span(numa_node).to_vec());
        assert_eq!(&span[..10], &[8, 9, 10, 11, 12, 13, 14, 15, 40, 41]);
    }

    #[test]
    fn big_little_noncontiguous_llcs() {
        let os: Vec<u64> = (0..6).collect();
        let llc = vec![0, 1, 1, 0, 0, 0];
        let t = TopologyBuilder::new(os)
            .level("LLC", DomainFlags::LLC, llc)
            .build()
            .unwrap();
        check_tree(&t);
        check_groups(&t);
        assert_eq!(t.llcs()[t.llc_of(0)].members, vec![0, 3, 4, 5]);
        assert_eq!(t.llcs()[t.llc_of(1)].members, vec![1, 2]);
        assert_eq!(t.llc_pos(4), 2);
        assert_eq!(t.smt_siblings(2), &[2]);
        assert_eq!(sorted(t.span(t.sd_llc(3)).to_vec()), vec![0, 3, 4, 5]);
    }

    #[test]
    fn sub_numa_clustering_splits_llc() {
        // 8 CPUs, one L3, two NUMA nodes (SNC-2): LLC is split per node.
        let os: Vec<u64> = (0..8).collect();
        let t = TopologyBuilder::new(os)
            .level("LLC", DomainFlags::LLC, vec![0; 8])
            .level("NUMA", DomainFlags::NUMA, vec![0, 0, 0, 0, 1, 1, 1, 1])
            .level("PKG", DomainFlags::PACKAGE, vec![0; 8])
            .build()
            .unwrap();
        check_tree(&t);
        check_groups(&t);
        assert_eq!(t.nr_numa(), 2);
        assert_eq!(t.sd_llc_size(0), 4);
        assert!(!t.share_llc(0, 4));
    }

    #[test]
    fn single_leaf_and_errors() {
        let t = TopologyBuilder::new(vec![7]).build().unwrap();
        check_tree(&t);
        check_groups(&t);
        assert_eq!(t.sd_llc_size(0), 1);
        assert_eq!(t.os_id(0), 7);
        assert_eq!(t.leaf_of_os_id(7), Some(0));
        assert_eq!(
            TopologyBuilder::new(vec![]).build().unwrap_err(),
            TopologyError::NoLeaves
        );
        assert!(matches!(
            TopologyBuilder::new(vec![0, 1])
                .level("x", DomainFlags::LLC, vec![0])
                .build(),
            Err(TopologyError::KeyCount { .. })
        ));
        for bad in [
            "",
            "2s:0c",
            "2x:3c",
            "2s:c",
            "1s:3c:numa=2",
            "2z:3r",
            "2z:4n:llc=2",
            "1s:2c:foo=1",
        ] {
            assert!(Topology::from_spec(bad).is_err(), "{bad} should not parse");
        }
    }

    #[test]
    fn levels_from_groups() {
        let t = TopologyBuilder::new(vec![0, 1, 2, 3])
            .level_from_groups("SMT", DomainFlags::SMT, &[vec![0, 2], vec![1, 3]])
            .unwrap()
            .level_from_groups("LLC", DomainFlags::LLC, &[vec![0, 1, 2, 3]])
            .unwrap()
            .build()
            .unwrap();
        assert_eq!(t.smt_siblings(0), &[0, 2]);
        let b = || TopologyBuilder::new(vec![0, 1]);
        assert!(matches!(
            b().level_from_groups("x", DomainFlags::LLC, &[vec![0]]),
            Err(TopologyError::BadGroups { .. })
        ));
        assert!(
            b().level_from_groups("x", DomainFlags::LLC, &[vec![0, 1], vec![1]])
                .is_err()
        );
        assert!(
            b().level_from_groups("x", DomainFlags::LLC, &[vec![0, 1, 7]])
                .is_err()
        );
    }

    #[test]
    fn cluster_spec() {
        let t = Topology::from_spec("2z:4r:8n:2h").unwrap();
        check_tree(&t);
        check_groups(&t);
        assert_eq!(t.nr_leaves(), 64);
        assert_eq!(t.nr_numa(), 2);
        assert_eq!(t.llcs().len(), 8);
        assert_eq!(t.sd_llc_size(9), 8);
        assert_eq!(t.smt_siblings(9), &[8, 9]);
        assert_eq!(t.numa_span(t.root()), 2);
        assert_eq!(t.llc_siblings(0), &[0, 1, 2, 3]);
        let big = Topology::from_spec("10z:100r:100n").unwrap();
        assert_eq!(big.nr_leaves(), 100_000);
        // A cluster's leaves are sorted by place: one vector for the
        // order, the cores, the zones and the region, and no outside ids.
        for groups in [big.cores(), big.numa_groups(), big.package_groups()] {
            assert!(Arc::ptr_eq(&groups.members, &big.order));
        }
        assert!(big.os_ids.is_empty());
        assert!(Arc::ptr_eq(&big.llcs()[99].members.all, &big.order));
        assert_eq!(
            big.llcs()[99].members.as_slice(),
            &(9_900..10_000).collect::<Vec<_>>()[..]
        );
        assert!(big.core_of.is_empty() && big.cores.ends.is_empty());
        assert_eq!(big.cores().len(), 100_000);
        assert_eq!(big.smt_siblings(4_321), &[4_321]);
        assert_eq!(big.os_id(99_999), 99_999);
    }

    #[test]
    fn llc_per_n_cores_and_numa_per_socket() {
        let t = Topology::from_spec("2s:8c:2t:llc=4:numa=2").unwrap();
        check_tree(&t);
        check_groups(&t);
        assert_eq!(t.llcs().len(), 4);
        assert_eq!(t.sd_llc_size(0), 8);
        assert_eq!(t.nr_numa(), 4);
        let seen: Vec<u32> = t.ancestors(0).map(|d| t.node(d).level()).collect();
        assert!(seen.windows(2).all(|w| w[0] < w[1]));
    }

    proptest::proptest! {
        /// The cores' one-vector groups are the groups of leaves by rank,
        /// each ascending, as one vector per group holds them.
        #[test]
        fn leaf_groups_are_the_ranked_groups(gid in proptest::collection::vec(0usize..12, 1..60)) {
            let (of, count) = rank_of(&gid);
            let g = LeafGroups::of(&of, count);
            let (lists, of2) = rank_groups(&gid);
            proptest::prop_assert_eq!(&of, &of2);
            proptest::prop_assert_eq!(g.len(), lists.len());
            let got: Vec<Vec<LeafId>> = g.iter().map(<[LeafId]>::to_vec).collect();
            proptest::prop_assert_eq!(&got, &lists);
            // The oracle: group r is the leaves whose group id ranks r,
            // ranks given by first appearance.
            let mut firsts: Vec<usize> = Vec::new();
            for &x in &gid {
                if !firsts.contains(&x) {
                    firsts.push(x);
                }
            }
            for (r, want) in firsts.iter().enumerate() {
                let leaves: Vec<LeafId> = (0..gid.len()).filter(|&l| gid[l] == *want).collect();
                proptest::prop_assert_eq!(g.get(r), leaves.as_slice());
            }
        }

        /// Random descriptions (up to four levels of random keys: nesting
        /// splits, degenerate levels merge, spans not contiguous in leaf
        /// ids): the packed nodes agree with a brute force over their
        /// parent chains (`check_tree`), and every level's domain is the
        /// leaves sharing its keys at that level and above.
        #[test]
        fn packed_trees_are_the_described_groups(
            n in 1usize..48,
            keys in proptest::collection::vec(proptest::collection::vec(0u64..4, 48), 0..5),
            first_id in 0u64..2,
        ) {
            let flags = [DomainFlags::SMT, DomainFlags::LLC, DomainFlags::NUMA, DomainFlags::PACKAGE];
            // Ids from 0 (stored as the identity) or from 1 (stored).
            let mut b = TopologyBuilder::new((0..n as u64).map(|i| first_id + i).collect());
            for (l, k) in keys.iter().enumerate() {
                b = b.level(&format!("l{l}"), flags[l % 4], k[..n].to_vec());
            }
            let t = b.build().unwrap();
            check_tree(&t);
        check_groups(&t);
            check_groups(&t);
            proptest::prop_assert_eq!(t.nr_leaves(), n);
            for leaf in 0..n {
                proptest::prop_assert_eq!(t.os_id(leaf), first_id + leaf as u64);
                proptest::prop_assert_eq!(t.leaf_of_os_id(first_id + leaf as u64), Some(leaf));
            }
            proptest::prop_assert_eq!(t.leaf_of_os_id(first_id + n as u64), None);
            proptest::prop_assert_eq!(t.leaf_of_os_id(u64::MAX), None);
            if first_id > 0 {
                proptest::prop_assert_eq!(t.leaf_of_os_id(0), None);
            }
            // The oracle: two leaves' lowest common domain is the group of
            // the lowest level at which their keys agree there and at every
            // outer level (index `l + 1`; the root `keys.len() + 1`): that
            // group splits them below, so it has two children and survives
            // the merge of degenerate domains.
            for a in 0..n {
                for c in (0..n).filter(|&c| c != a) {
                    let common = t.ancestors(a).find(|&d| t.span(d).contains(&c));
                    let together = (0..=keys.len())
                        .find(|&l| (l..keys.len()).all(|m| keys[m][a] == keys[m][c]))
                        .unwrap();
                    let common = common.unwrap();
                    proptest::prop_assert_eq!(t.node(common).level() as usize, together + 1);
                }
            }
        }
    }
}
