//! Hardware topology discovery: this module owns reading the machine's
//! topology and turning it into the engine's [`sched::topology::Topology`].
//!
//! **Invariant: only `agent::topology` reads `/sys`** (and the affinity line
//! of `/proc/self/status`). Everything else in the agent asks this module,
//! so every read goes through one [`SysfsReader`] and its root prefix, and a
//! captured tree of another machine (a test fixture, a bug report) can be
//! read exactly like the live one. This is the seam `scx_utils` calls
//! `SCX_SYSFS_PREFIX`.
//!
//! What is read, under `<root>/sys/devices/system/`:
//!
//! * `cpu/online`: the CPUs to describe. Offline CPUs and holes in the
//!   numbering are normal; an offline CPU's directories are never touched
//!   (the kernel removes its `topology/` and `cache/` on hot-unplug).
//! * `cpu/cpuN/topology/`: `core_cpus_list` (or the older
//!   `thread_siblings_list`) for SMT siblings, `core_id`,
//!   `physical_package_id`, and the optional `die_id` and `cluster_id`.
//! * `cpu/cpuN/cache/index*/`: the last-level cache is the highest-`level`
//!   cache whose `type` is `Unified` (or `Data` when no unified cache is
//!   listed): L3 on most x86, L2 on POWER10 and on many Arm machines. It is
//!   identified by `id` when the kernel provides one, else by its
//!   `shared_cpu_list`, and a cache id is only compared within one level
//!   and type, as the kernel defines it.
//! * `node/nodeN/cpulist`: NUMA nodes. The directory is absent without
//!   `CONFIG_NUMA` (then the machine is one node) and node ids may be sparse
//!   (POWER: 0, 1, 4, 5).
//!
//! PCI devices (GPUs, accelerators, network adapters) and their place in
//! the machine are read by the [`devices`] submodule, through the same
//! reader and root.
//!
//! The reader's files come from the filesystem ([`SysfsReader::new`]), or
//! from a [`SysfsTree`] held in memory ([`SysfsReader::in_memory`]), which
//! the [`source`] submodule makes answer like the filesystem; the parsing
//! is the same code either way.
//!
//! Groups are keyed by what the kernel says is shared (the sibling list, the
//! cache), never by `core_id` alone: core ids repeat across packages on x86
//! and across clusters on Arm.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use sched::topology::{DomainFlags, TopoSpec, Topology, TopologyBuilder};

pub mod devices;
pub mod source;

pub use devices::{DeviceKind, PciDevice, PcieLink};
pub use source::SysfsTree;

use source::Source;

/// The largest CPU id a CPU list may name. Linux's `NR_CPUS` tops out at
/// 8192; the margin keeps a corrupt file from allocating gigabytes.
pub const MAX_CPU_ID: u32 = (1 << 20) - 1;

/// Why a CPU list ("0-3,8,10-11") could not be parsed.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum CpulistError {
    /// Two commas in a row, or a trailing comma.
    #[error("empty element at byte {pos}")]
    EmptyItem {
        /// Byte offset of the element in the list.
        pos: usize,
    },
    /// Something that is not a decimal CPU number.
    #[error("{text:?} at byte {pos} is not a CPU number")]
    BadNumber {
        /// The offending text.
        text: String,
        /// Byte offset of the element in the list.
        pos: usize,
    },
    /// A range whose end is below its start.
    #[error("range {lo}-{hi} at byte {pos} is reversed")]
    Reversed {
        /// Start of the range.
        lo: u32,
        /// End of the range.
        hi: u32,
        /// Byte offset of the element in the list.
        pos: usize,
    },
    /// A CPU id above [`MAX_CPU_ID`].
    #[error("CPU {cpu} is above the largest supported CPU id {MAX_CPU_ID}")]
    TooLarge {
        /// The id as written (saturated to `u64`).
        cpu: u64,
    },
    /// A stride suffix (`0-15:2/4`) that is not `<used>/<group>` with
    /// `0 < used <= group`.
    #[error("bad stride {text:?} at byte {pos}: want <used>/<group> with 0 < used <= group")]
    BadStride {
        /// The offending suffix.
        text: String,
        /// Byte offset of the element in the list.
        pos: usize,
    },
}

/// Parse the kernel's CPU list format (`cpulist_parse`): comma-separated
/// CPU numbers and inclusive ranges, e.g. `"0-3,8,10-11"`, optionally with
/// the stride form `"0-15:2/4"` (the first 2 of every 4). Surrounding
/// whitespace and the trailing newline of a sysfs file are ignored; an empty
/// list is the empty set. Returns the CPUs sorted and without duplicates.
pub fn parse_cpulist(text: &str) -> Result<Vec<u32>, CpulistError> {
    // A bitmap filled a word at a time: a corrupt "0-1048575" costs
    // 16,384 words, not a million steps.
    let mut bits: Vec<u64> = Vec::new();
    let mut set_range = |lo: u32, hi: u32| {
        let (first, last) = ((lo / 64) as usize, (hi / 64) as usize);
        if bits.len() <= last {
            bits.resize(last + 1, 0);
        }
        for (w, word) in bits[first..=last].iter_mut().enumerate() {
            let from = if w == 0 { lo % 64 } else { 0 };
            let to = if first + w == last { hi % 64 } else { 63 };
            *word |= (u64::MAX >> (63 - to)) & (u64::MAX << from);
        }
    };
    let list = text.trim();
    if list.is_empty() {
        return Ok(Vec::new());
    }
    let base = text.len() - text.trim_start().len();
    let mut offset = base;
    for raw in list.split(',') {
        let pos = offset + (raw.len() - raw.trim_start().len());
        offset += raw.len() + 1;
        let item = raw.trim();
        if item.is_empty() {
            return Err(CpulistError::EmptyItem { pos });
        }
        let (range, stride) = match item.split_once(':') {
            Some((range, stride)) => (range, Some(stride)),
            None => (item, None),
        };
        let (lo, hi) = match range.split_once('-') {
            Some((lo, hi)) => (parse_cpu(lo, pos)?, parse_cpu(hi, pos)?),
            None => {
                let cpu = parse_cpu(range, pos)?;
                (cpu, cpu)
            }
        };
        if hi < lo {
            return Err(CpulistError::Reversed { lo, hi, pos });
        }
        let (used, group) = match stride {
            None => (1, 1),
            Some(s) => {
                let bad = || CpulistError::BadStride {
                    text: s.to_string(),
                    pos,
                };
                let (used, group) = s.split_once('/').ok_or_else(bad)?;
                let used: u32 = used.trim().parse().map_err(|_| bad())?;
                let group: u32 = group.trim().parse().map_err(|_| bad())?;
                if used == 0 || used > group {
                    return Err(bad());
                }
                (used, group)
            }
        };
        // The first `used` of every `group` CPUs from `lo`.
        let mut start = lo;
        loop {
            set_range(start, hi.min(start.saturating_add(used - 1)));
            match start.checked_add(group) {
                Some(next) if next <= hi => start = next,
                _ => break,
            }
        }
    }
    let mut cpus = Vec::with_capacity(bits.iter().map(|w| w.count_ones() as usize).sum());
    for (w, &word) in bits.iter().enumerate() {
        let base = w as u32 * 64;
        if word == u64::MAX {
            cpus.extend(base..base + 64);
            continue;
        }
        let mut rest = word;
        while rest != 0 {
            cpus.push(base + rest.trailing_zeros());
            rest &= rest - 1;
        }
    }
    Ok(cpus)
}

fn parse_cpu(text: &str, pos: usize) -> Result<u32, CpulistError> {
    let t = text.trim();
    if t.is_empty() || !t.bytes().all(|b| b.is_ascii_digit()) {
        return Err(CpulistError::BadNumber {
            text: text.to_string(),
            pos,
        });
    }
    // All digits: parsing can only fail by overflow.
    let cpu = t.parse::<u64>().unwrap_or(u64::MAX);
    if cpu > u64::from(MAX_CPU_ID) {
        return Err(CpulistError::TooLarge { cpu });
    }
    Ok(cpu as u32)
}

/// Format CPUs in the kernel's CPU list format, collapsing runs into
/// ranges: `[0, 1, 2, 3, 8, 10, 11]` gives `"0-3,8,10-11"`. The input need
/// not be sorted; duplicates are ignored; the empty set gives `""`.
pub fn format_cpulist(cpus: &[u32]) -> String {
    let mut sorted = cpus.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut out = String::new();
    let mut i = 0;
    while i < sorted.len() {
        let mut j = i;
        while j + 1 < sorted.len() && sorted[j + 1] == sorted[j] + 1 {
            j += 1;
        }
        if !out.is_empty() {
            out.push(',');
        }
        if i == j {
            let _ = write!(out, "{}", sorted[i]);
        } else {
            let _ = write!(out, "{}-{}", sorted[i], sorted[j]);
        }
        i = j + 1;
    }
    out
}

/// Errors from discovering a topology. Every error about a file names it.
#[derive(Debug, Error)]
pub enum DiscoveryError {
    /// A file the reader needs does not exist.
    #[error("{path}: missing (not a Linux sysfs tree, or the kernel does not provide it)")]
    Missing {
        /// The file.
        path: PathBuf,
    },
    /// A file exists but could not be read.
    #[error("{path}: cannot read: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// A file holds a malformed CPU list.
    #[error("{path}: bad CPU list {text:?}: {source}")]
    Cpulist {
        /// The file.
        path: PathBuf,
        /// Its contents, trimmed.
        text: String,
        /// What is wrong with it.
        #[source]
        source: CpulistError,
    },
    /// A file that should hold an integer does not.
    #[error("{path}: expected an integer, found {text:?}")]
    BadInt {
        /// The file.
        path: PathBuf,
        /// Its contents, trimmed.
        text: String,
    },
    /// A file's contents contradict the rest of the tree.
    #[error("{path}: {reason}")]
    Inconsistent {
        /// The file.
        path: PathBuf,
        /// What does not agree.
        reason: String,
    },
    /// No CPU is both online and allowed.
    #[error("no usable CPUs: online {online:?}, allowed {allowed:?}")]
    NoCpus {
        /// The online CPUs, as a CPU list.
        online: String,
        /// The allowed CPUs, as a CPU list.
        allowed: String,
    },
    /// A synthetic spec that does not describe a machine of CPUs.
    #[error("synthetic topology {spec:?}: {reason}")]
    Synthetic {
        /// The spec as given.
        spec: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The engine rejected the tree (or the spec string).
    #[error(transparent)]
    Sched(#[from] sched::topology::TopologyError),
}

/// Result of discovery.
pub type Result<T, E = DiscoveryError> = std::result::Result<T, E>;

/// Kind of the cache chosen as the last-level cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum CacheKind {
    /// A unified (data and instruction) cache: the usual LLC.
    Unified,
    /// A data cache, used when no unified cache is listed.
    Data,
    /// No cache information (no `cache/` directory, or a synthetic
    /// machine's implied cache).
    Unknown,
}

/// The last-level cache shared by a group of CPUs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheInfo {
    /// Cache level (3 for an L3); 0 when the kernel lists no caches and the
    /// package stands in for the LLC.
    pub level: u8,
    /// The cache's type.
    pub kind: CacheKind,
    /// The kernel's `cache/indexN/id`, unique per level and type, when it
    /// provides one (powerpc and many Arm device trees do not).
    pub kernel_id: Option<u64>,
    /// The CPUs sharing it as the kernel lists them (`shared_cpu_list`):
    /// may include CPUs that are offline or not allowed.
    pub shared_cpus: Vec<u32>,
}

impl CacheInfo {
    /// A short name: `L3`, `L2d` for a data cache, `LLC?` when unknown.
    pub fn name(&self) -> String {
        match (self.kind, self.level) {
            (CacheKind::Unknown, 0) => "LLC?".to_string(),
            (CacheKind::Data, l) => format!("L{l}d"),
            (_, l) => format!("L{l}"),
        }
    }
}

/// One usable logical CPU and where it sits.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CpuInfo {
    /// The CPU number (`cpuN`).
    pub cpu: u32,
    /// `topology/core_id`: unique only within a package (x86) or a cluster
    /// (Arm), and informational: cores are grouped by `smt_siblings`. A
    /// negative value (unknown) is replaced by the CPU number.
    pub core_id: u32,
    /// `topology/die_id`; `None` when absent or -1.
    pub die_id: Option<u32>,
    /// `topology/physical_package_id`; -1 (unknown) is read as package 0.
    pub package_id: u32,
    /// `topology/cluster_id`; `None` when absent, -1, or x86's "no cluster"
    /// value 65535.
    pub cluster_id: Option<u32>,
    /// The NUMA node holding this CPU; `None` when the kernel has no `node`
    /// directory (one node) or lists this CPU in no node.
    pub numa_node: Option<u32>,
    /// Index of this CPU's last-level cache in [`MachineTopology::llcs`].
    pub llc_id: usize,
    /// The usable CPUs of this CPU's core, itself included, ascending.
    pub smt_siblings: Vec<u32>,
}

/// The usable CPUs of one machine and how they are grouped: the input to
/// [`MachineTopology::to_sched`], the JSON summary and the tree view.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MachineTopology {
    /// Where it came from ("sysfs /", "synthetic 2s:22c:2t").
    pub source: String,
    /// All online CPUs, before the `allowed` filter.
    pub online: Vec<u32>,
    /// The filter applied to `online`, if any.
    pub allowed: Option<Vec<u32>>,
    /// The usable (online and allowed) CPUs, ascending by CPU number.
    pub cpus: Vec<CpuInfo>,
    /// The last-level caches of the usable CPUs, numbered in order of their
    /// lowest usable CPU.
    pub llcs: Vec<CacheInfo>,
    /// The GPUs, accelerators and network adapters, by PCI address.
    pub devices: Vec<PciDevice>,
}

/// The JSON summary printed by `agent topology --json`. Each grouping is a
/// sorted list of sorted CPU-id lists over the usable CPUs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopologySummary {
    /// Where the topology came from.
    pub source: String,
    /// The online CPUs, as a CPU list.
    pub online: String,
    /// The allowed CPUs, as a CPU list; `None` when unrestricted.
    pub allowed: Option<String>,
    /// The usable CPUs.
    pub cpus: Vec<u32>,
    /// Hardware threads of one core.
    pub smt: Vec<Vec<u32>>,
    /// CPUs sharing a last-level cache.
    pub llc: Vec<Vec<u32>>,
    /// Name of each `llc` group's cache ("L3", "L2"), in the same order.
    pub llc_cache: Vec<String>,
    /// CPUs of one NUMA node.
    pub numa: Vec<Vec<u32>>,
    /// The node id of each `numa` group, in the same order (`None`: no NUMA
    /// information).
    pub numa_ids: Vec<Option<u32>>,
    /// CPUs of one package (socket).
    pub package: Vec<Vec<u32>>,
    /// The GPUs, accelerators and network adapters, by PCI address (absent
    /// from the JSON when there are none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<PciDevice>,
}

impl TopologySummary {
    /// JSON text: one object, one key per line (keys sorted), each value
    /// compact, so a 320-CPU machine stays readable.
    pub fn to_json(&self) -> serde_json::Result<String> {
        let value = serde_json::to_value(self)?;
        let mut out = String::from("{");
        if let serde_json::Value::Object(map) = value {
            for (i, (key, value)) in map.iter().enumerate() {
                let sep = if i == 0 { "" } else { "," };
                let _ = write!(
                    out,
                    "{sep}\n  {}: {}",
                    serde_json::to_string(key)?,
                    serde_json::to_string(value)?
                );
            }
        }
        out.push_str("\n}");
        Ok(out)
    }
}

/// Reads a machine's topology from a sysfs tree under a root prefix, on
/// disk or in memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SysfsReader {
    root: PathBuf,
    source: Source,
}

impl Default for SysfsReader {
    fn default() -> Self {
        Self::host()
    }
}

/// Raw per-CPU attributes, before LLC interning.
struct RawCpu {
    cpu: u32,
    core_id: u32,
    die_id: Option<u32>,
    package_id: u32,
    cluster_id: Option<u32>,
    siblings: Vec<u32>,
    siblings_path: PathBuf,
    llc: Option<RawCache>,
}

struct RawCache {
    level: u8,
    kind: CacheKind,
    id: Option<u64>,
    shared: Vec<u32>,
}

/// Identity of a last-level cache: the kernel's id (unique per level and
/// type), else the CPUs sharing it, else (no cache info) the package.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum LlcKey {
    Id(u8, CacheKind, u64),
    Shared(u8, CacheKind, Vec<u32>),
    Package(u32),
}

impl SysfsReader {
    /// A reader of the live machine (root `/`).
    pub fn host() -> Self {
        Self::new("/")
    }

    /// A reader of the tree under `root`: reads
    /// `<root>/sys/devices/system/...` and `<root>/proc/self/status`.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self {
            root: root.into(),
            source: Source::Disk,
        }
    }

    /// A reader of `tree`, held in memory, as if it were mounted at `root`:
    /// the root only names files in errors and in the topology's source.
    pub fn in_memory(root: impl Into<PathBuf>, tree: SysfsTree) -> Self {
        Self {
            root: root.into(),
            source: Source::Memory(Arc::new(tree)),
        }
    }

    /// Whether this reader reads a tree in memory rather than files.
    pub fn is_in_memory(&self) -> bool {
        matches!(self.source, Source::Memory(_))
    }

    /// The root prefix.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// `<root>/sys/devices/system/cpu`.
    pub fn cpu_dir(&self) -> PathBuf {
        self.root.join("sys/devices/system/cpu")
    }

    /// `<root>/sys/devices/system/node`.
    pub fn node_dir(&self) -> PathBuf {
        self.root.join("sys/devices/system/node")
    }

    /// `<root>/proc/self/status`.
    pub fn status_path(&self) -> PathBuf {
        self.root.join("proc/self/status")
    }

    /// The online CPUs (`cpu/online`).
    pub fn online(&self) -> Result<Vec<u32>> {
        self.read_cpulist(&self.cpu_dir().join("online"))
    }

    /// The CPUs this process may run on: `Cpus_allowed_list` of
    /// `<root>/proc/self/status` (the kernel's view of
    /// `sched_getaffinity`).
    pub fn process_affinity(&self) -> Result<Vec<u32>> {
        let path = self.status_path();
        let status = self.read_string(&path)?;
        let line = status
            .lines()
            .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))
            .ok_or_else(|| DiscoveryError::Inconsistent {
                path: path.clone(),
                reason: "no Cpus_allowed_list line".to_string(),
            })?;
        parse_cpulist(line).map_err(|source| DiscoveryError::Cpulist {
            path,
            text: line.trim().to_string(),
            source,
        })
    }

    /// The default `allowed` filter: this process's affinity when the root
    /// has a `proc/self/status` (the live machine), `None` for a captured
    /// sysfs tree without one.
    pub fn default_allowed(&self) -> Result<Option<Vec<u32>>> {
        if self.exists(&self.status_path()) {
            self.process_affinity().map(Some)
        } else {
            Ok(None)
        }
    }

    /// Read the topology of the online CPUs, restricted to `allowed` when
    /// given (allowed CPUs that are not online are ignored). Fails when no
    /// CPU is left, or when a file the kernel always provides is missing or
    /// malformed; optional files fall back as documented on [`CpuInfo`].
    pub fn read(&self, allowed: Option<&[u32]>) -> Result<MachineTopology> {
        let online = self.online()?;
        let allowed: Option<Vec<u32>> = allowed.map(|a| {
            let mut a = a.to_vec();
            a.sort_unstable();
            a.dedup();
            a
        });
        let usable: Vec<u32> = match &allowed {
            Some(allowed) => online
                .iter()
                .copied()
                .filter(|c| allowed.binary_search(c).is_ok())
                .collect(),
            None => online.clone(),
        };
        if usable.is_empty() {
            return Err(DiscoveryError::NoCpus {
                online: format_cpulist(&online),
                allowed: allowed
                    .as_deref()
                    .map_or_else(|| "all".to_string(), format_cpulist),
            });
        }
        let numa = self.read_numa(&usable)?;
        let mut raw = Vec::with_capacity(usable.len());
        for &cpu in &usable {
            raw.push(self.read_cpu(cpu)?);
        }
        check_siblings(&raw)?;

        let mut llc_index: HashMap<LlcKey, usize> = HashMap::new();
        let mut llcs: Vec<CacheInfo> = Vec::new();
        let mut cpus = Vec::with_capacity(raw.len());
        for r in raw {
            let (key, info) = match r.llc {
                Some(c) => {
                    let key = match c.id {
                        Some(id) => LlcKey::Id(c.level, c.kind, id),
                        None => LlcKey::Shared(c.level, c.kind, c.shared.clone()),
                    };
                    let info = CacheInfo {
                        level: c.level,
                        kind: c.kind,
                        kernel_id: c.id,
                        shared_cpus: c.shared,
                    };
                    (key, info)
                }
                None => (
                    LlcKey::Package(r.package_id),
                    CacheInfo {
                        level: 0,
                        kind: CacheKind::Unknown,
                        kernel_id: None,
                        shared_cpus: Vec::new(),
                    },
                ),
            };
            let llc_id = *llc_index.entry(key).or_insert_with(|| {
                llcs.push(info);
                llcs.len() - 1
            });
            let smt_siblings = r
                .siblings
                .iter()
                .copied()
                .filter(|c| usable.binary_search(c).is_ok())
                .collect();
            cpus.push(CpuInfo {
                cpu: r.cpu,
                core_id: r.core_id,
                die_id: r.die_id,
                package_id: r.package_id,
                cluster_id: r.cluster_id,
                numa_node: numa.get(&r.cpu).copied(),
                llc_id,
                smt_siblings,
            });
        }
        // A package-implied LLC lists the package's usable CPUs.
        for (i, info) in llcs.iter_mut().enumerate() {
            if info.kind == CacheKind::Unknown {
                info.shared_cpus = cpus
                    .iter()
                    .filter(|c| c.llc_id == i)
                    .map(|c| c.cpu)
                    .collect();
            }
        }
        let usable_ids: Vec<u32> = cpus.iter().map(|c: &CpuInfo| c.cpu).collect();
        let devices = self.read_devices(&usable_ids, |cpu| {
            usable_ids
                .binary_search(&cpu)
                .ok()
                .and_then(|i| cpus[i].numa_node)
        })?;
        let source = match self.source {
            Source::Disk => format!("sysfs {}", self.root.display()),
            Source::Memory(_) => format!("sysfs in memory {}", self.root.display()),
        };
        Ok(MachineTopology {
            source,
            online,
            allowed,
            cpus,
            llcs,
            devices,
        })
    }

    /// Usable CPU -> NUMA node, from `node/nodeN/cpulist`; empty without a
    /// `node` directory. A usable CPU listed in two nodes is an error; the
    /// other CPUs the lists name are not looked at (a corrupt list naming
    /// a million CPUs costs no million-entry map).
    fn read_numa(&self, usable: &[u32]) -> Result<HashMap<u32, u32>> {
        let dir = self.node_dir();
        let mut map = HashMap::new();
        let Some(names) = self.list_dir(&dir)? else {
            return Ok(map);
        };
        let mut nodes: Vec<u32> = names
            .iter()
            .filter_map(|name| numbered(&name.to_string_lossy(), "node"))
            .collect();
        nodes.sort_unstable();
        for node in nodes {
            let path = dir.join(format!("node{node}/cpulist"));
            let listed = self.read_cpulist(&path)?;
            for &cpu in usable.iter().filter(|c| listed.binary_search(c).is_ok()) {
                if let Some(other) = map.insert(cpu, node) {
                    return Err(DiscoveryError::Inconsistent {
                        path,
                        reason: format!("CPU {cpu} is also in node {other}"),
                    });
                }
            }
        }
        Ok(map)
    }

    fn read_cpu(&self, cpu: u32) -> Result<RawCpu> {
        let dir = self.cpu_dir().join(format!("cpu{cpu}"));
        let topo = dir.join("topology");
        let core_id = self.read_int(&topo.join("core_id"))?;
        let core_id = u32::try_from(core_id).unwrap_or(cpu);
        let package_id = self.read_int(&topo.join("physical_package_id"))?;
        let package_id = u32::try_from(package_id).unwrap_or(0);
        let die_id = self
            .read_optional_int(&topo.join("die_id"))?
            .and_then(|v| u32::try_from(v).ok());
        let cluster_id = self
            .read_optional_int(&topo.join("cluster_id"))?
            .and_then(|v| u32::try_from(v).ok())
            .filter(|&v| v != u32::from(u16::MAX));
        let (siblings, siblings_path) = {
            let new = topo.join("core_cpus_list");
            match self.read_optional(&new)? {
                Some(text) => (parse_cpulist_at(&new, &text)?, new),
                None => {
                    let old = topo.join("thread_siblings_list");
                    (self.read_cpulist(&old)?, old)
                }
            }
        };
        if !siblings.contains(&cpu) {
            return Err(DiscoveryError::Inconsistent {
                path: siblings_path,
                reason: format!("CPU {cpu} is not among its own siblings"),
            });
        }
        let llc = self.read_llc(&dir.join("cache"))?;
        Ok(RawCpu {
            cpu,
            core_id,
            die_id,
            package_id,
            cluster_id,
            siblings,
            siblings_path,
            llc,
        })
    }
}

impl SysfsReader {
    /// The last-level cache listed under a CPU's `cache/` directory; `None`
    /// when there is no directory or no data/unified cache in it.
    fn read_llc(&self, cache_dir: &Path) -> Result<Option<RawCache>> {
        let Some(names) = self.list_dir(cache_dir)? else {
            return Ok(None);
        };
        let mut indexes: Vec<u32> = names
            .iter()
            .filter_map(|name| numbered(&name.to_string_lossy(), "index"))
            .collect();
        indexes.sort_unstable();
        let mut listed = Vec::new();
        for i in indexes {
            let dir = cache_dir.join(format!("index{i}"));
            let level_path = dir.join("level");
            let level = self.read_int(&level_path)?;
            let level = u8::try_from(level).map_err(|_| DiscoveryError::Inconsistent {
                path: level_path,
                reason: format!("cache level {level} is out of range"),
            })?;
            if let Some(kind) = parse_cache_type(&self.read_string(&dir.join("type"))?) {
                listed.push((dir, level, kind));
            }
        }
        let Some(best) = pick_llc(listed.iter().map(|(_, level, kind)| (*level, *kind))) else {
            return Ok(None);
        };
        let (dir, level, kind) = &listed[best];
        let id = self
            .read_optional_int(&dir.join("id"))?
            .and_then(|v| u64::try_from(v).ok());
        let shared = self.read_cpulist(&dir.join("shared_cpu_list"))?;
        Ok(Some(RawCache {
            level: *level,
            kind: *kind,
            id,
            shared,
        }))
    }

    /// The file at `path` as text.
    fn read_string(&self, path: &Path) -> Result<String> {
        self.source
            .read_to_string(&self.root, path)
            .map_err(|source| io_error(path, source))
    }

    /// The file at `path` as text; `None` when it does not exist.
    fn read_optional(&self, path: &Path) -> Result<Option<String>> {
        match self.read_string(path) {
            Ok(s) => Ok(Some(s)),
            Err(DiscoveryError::Missing { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn read_int(&self, path: &Path) -> Result<i64> {
        parse_int_at(path, &self.read_string(path)?)
    }

    fn read_optional_int(&self, path: &Path) -> Result<Option<i64>> {
        self.read_optional(path)?
            .map(|t| parse_int_at(path, &t))
            .transpose()
    }

    fn read_cpulist(&self, path: &Path) -> Result<Vec<u32>> {
        parse_cpulist_at(path, &self.read_string(path)?)
    }

    /// The names in the directory `dir`; `None` when it does not exist.
    fn list_dir(&self, dir: &Path) -> Result<Option<Vec<std::ffi::OsString>>> {
        match self.source.list_dir(&self.root, dir) {
            Ok(names) => Ok(Some(names)),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(source) => Err(DiscoveryError::Io {
                path: dir.to_path_buf(),
                source,
            }),
        }
    }

    /// Whether `path` exists (links followed).
    fn exists(&self, path: &Path) -> bool {
        self.source.exists(&self.root, path)
    }

    /// The target of the symbolic link at `path`.
    fn read_link(&self, path: &Path) -> Result<PathBuf> {
        self.source
            .read_link(&self.root, path)
            .map_err(|source| DiscoveryError::Io {
                path: path.to_path_buf(),
                source,
            })
    }
}

/// Choose the last-level cache among `(level, kind)` entries: the highest
/// level among unified caches, else the highest data cache; the first such
/// entry on ties. Returns its position.
pub(crate) fn pick_llc(caches: impl IntoIterator<Item = (u8, CacheKind)>) -> Option<usize> {
    let mut best: Option<(usize, u8, CacheKind)> = None;
    for (i, (level, kind)) in caches.into_iter().enumerate() {
        if !matches!(kind, CacheKind::Unified | CacheKind::Data) {
            continue;
        }
        let better = match best {
            None => true,
            Some((_, best_level, best_kind)) => {
                let rank = |k: CacheKind| u8::from(k == CacheKind::Unified);
                (rank(kind), level) > (rank(best_kind), best_level)
            }
        };
        if better {
            best = Some((i, level, kind));
        }
    }
    best.map(|(i, _, _)| i)
}

/// Every CPU listed as a sibling must list the same siblings.
fn check_siblings(raw: &[RawCpu]) -> Result<()> {
    let by_cpu: HashMap<u32, &RawCpu> = raw.iter().map(|r| (r.cpu, r)).collect();
    for r in raw {
        for s in &r.siblings {
            if let Some(other) = by_cpu.get(s)
                && other.siblings != r.siblings
            {
                return Err(DiscoveryError::Inconsistent {
                    path: other.siblings_path.clone(),
                    reason: format!(
                        "CPU {} lists siblings {:?} but CPU {} lists {:?}",
                        other.cpu,
                        format_cpulist(&other.siblings),
                        r.cpu,
                        format_cpulist(&r.siblings)
                    ),
                });
            }
        }
    }
    Ok(())
}

/// `prefix<digits>` -> the number.
fn numbered(name: &str, prefix: &str) -> Option<u32> {
    let digits = name.strip_prefix(prefix)?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// A failed read of `path`: `Missing` when it does not exist.
fn io_error(path: &Path, source: io::Error) -> DiscoveryError {
    if source.kind() == io::ErrorKind::NotFound {
        DiscoveryError::Missing {
            path: path.to_path_buf(),
        }
    } else {
        DiscoveryError::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

/// Parse a cache's `type` file: the kinds a last-level cache may be;
/// `None` for `Instruction` or a type we do not schedule by.
pub fn parse_cache_type(text: &str) -> Option<CacheKind> {
    match text.trim() {
        "Unified" => Some(CacheKind::Unified),
        "Data" => Some(CacheKind::Data),
        _ => None,
    }
}

/// Parse a sysfs integer file (`core_id`, `physical_package_id`, a cache's
/// `level` or `id`, ...): a decimal number, surrounding whitespace and the
/// trailing newline ignored.
pub fn parse_sysfs_int(text: &str) -> Option<i64> {
    text.trim().parse().ok()
}

fn parse_int_at(path: &Path, text: &str) -> Result<i64> {
    parse_sysfs_int(text).ok_or_else(|| DiscoveryError::BadInt {
        path: path.to_path_buf(),
        text: text.trim().to_string(),
    })
}

fn parse_cpulist_at(path: &Path, text: &str) -> Result<Vec<u32>> {
    parse_cpulist(text).map_err(|source| DiscoveryError::Cpulist {
        path: path.to_path_buf(),
        text: text.trim().to_string(),
        source,
    })
}

/// Group CPUs by a key; groups sorted inside and among themselves, each
/// with its key.
fn group_by<K: Ord + Clone>(cpus: &[CpuInfo], key: impl Fn(&CpuInfo) -> K) -> Vec<(Vec<u32>, K)> {
    let mut map: BTreeMap<K, Vec<u32>> = BTreeMap::new();
    for c in cpus {
        map.entry(key(c)).or_default().push(c.cpu);
    }
    let mut groups: Vec<(Vec<u32>, K)> = map
        .into_iter()
        .map(|(k, mut g)| {
            g.sort_unstable();
            (g, k)
        })
        .collect();
    groups.sort_by(|a, b| a.0.cmp(&b.0));
    groups
}

fn groups_only<K>(groups: Vec<(Vec<u32>, K)>) -> Vec<Vec<u32>> {
    groups.into_iter().map(|(g, _)| g).collect()
}

impl MachineTopology {
    /// Number of usable CPUs.
    pub fn nr_cpus(&self) -> usize {
        self.cpus.len()
    }

    /// The usable CPU numbers, ascending.
    pub fn cpu_ids(&self) -> Vec<u32> {
        self.cpus.iter().map(|c| c.cpu).collect()
    }

    /// The description of usable CPU `cpu`.
    pub fn cpu(&self, cpu: u32) -> Option<&CpuInfo> {
        self.cpus
            .binary_search_by_key(&cpu, |c| c.cpu)
            .ok()
            .map(|i| &self.cpus[i])
    }

    /// Cores: groups of SMT siblings.
    pub fn smt_groups(&self) -> Vec<Vec<u32>> {
        groups_only(group_by(&self.cpus, |c| c.smt_siblings.clone()))
    }

    /// Groups of CPUs sharing a last-level cache.
    pub fn llc_groups(&self) -> Vec<Vec<u32>> {
        groups_only(group_by(&self.cpus, |c| c.llc_id))
    }

    /// NUMA nodes (one group when there is no NUMA information).
    pub fn numa_groups(&self) -> Vec<Vec<u32>> {
        groups_only(group_by(&self.cpus, |c| c.numa_node))
    }

    /// Packages (sockets).
    pub fn package_groups(&self) -> Vec<Vec<u32>> {
        groups_only(group_by(&self.cpus, |c| c.package_id))
    }

    /// The summary printed as JSON.
    pub fn summary(&self) -> TopologySummary {
        let llc = group_by(&self.cpus, |c| c.llc_id);
        let numa = group_by(&self.cpus, |c| c.numa_node);
        TopologySummary {
            source: self.source.clone(),
            online: format_cpulist(&self.online),
            allowed: self.allowed.as_deref().map(format_cpulist),
            cpus: self.cpu_ids(),
            smt: self.smt_groups(),
            llc_cache: llc.iter().map(|(_, i)| self.llcs[*i].name()).collect(),
            llc: groups_only(llc),
            numa_ids: numa.iter().map(|(_, id)| *id).collect(),
            numa: groups_only(numa),
            package: self.package_groups(),
            devices: self.devices.clone(),
        }
    }

    /// Build the engine's tree: leaves are the usable CPUs (os ids = CPU
    /// numbers, leaf `i` = `cpus[i]`), levels SMT, LLC, NUMA and PKG. The
    /// engine nests each level inside the outer ones and drops degenerate
    /// levels.
    pub fn to_sched(&self) -> Result<Topology> {
        let os_ids = self.cpus.iter().map(|c| u64::from(c.cpu)).collect();
        let mut core_index: HashMap<&[u32], u64> = HashMap::new();
        let smt = self
            .cpus
            .iter()
            .map(|c| {
                let next = core_index.len() as u64;
                *core_index.entry(&c.smt_siblings).or_insert(next)
            })
            .collect();
        let llc = self.cpus.iter().map(|c| c.llc_id as u64).collect();
        let numa = self
            .cpus
            .iter()
            .map(|c| c.numa_node.map_or(u64::MAX, u64::from))
            .collect();
        let pkg = self.cpus.iter().map(|c| u64::from(c.package_id)).collect();
        Ok(TopologyBuilder::new(os_ids)
            .level("SMT", DomainFlags::SMT, smt)
            .level("LLC", DomainFlags::LLC, llc)
            .level("NUMA", DomainFlags::NUMA, numa)
            .level("PKG", DomainFlags::PACKAGE, pkg)
            .build()?)
    }

    /// A readable tree in the spirit of `lstopo`: Machine, then Package ->
    /// NUMANode -> cache -> Core -> PU, each line indented under its
    /// parent. `L#` numbers objects in tree order, `P#` is the kernel's id.
    pub fn tree(&self) -> String {
        let mut root = TreeNode::default();
        let mut core_index: HashMap<&[u32], u64> = HashMap::new();
        for (i, c) in self.cpus.iter().enumerate() {
            let next = core_index.len() as u64;
            let core = *core_index.entry(&c.smt_siblings).or_insert(next);
            let keys = [
                u64::from(c.package_id),
                c.numa_node.map_or(u64::MAX, u64::from),
                c.llc_id as u64,
                core,
                u64::from(c.cpu),
            ];
            let mut node = &mut root;
            node.cpus.push(c.cpu);
            for key in keys {
                let pos = match node.children.iter().position(|n| n.key == key) {
                    Some(pos) => pos,
                    None => {
                        node.children.push(TreeNode {
                            key,
                            first: i,
                            ..TreeNode::default()
                        });
                        node.children.len() - 1
                    }
                };
                node = &mut node.children[pos];
                node.cpus.push(c.cpu);
            }
        }
        let mut out = String::new();
        let ids = self.cpu_ids();
        let restricted = if ids == self.online {
            String::new()
        } else {
            format!(" of {} online", self.online.len())
        };
        let _ = writeln!(
            out,
            "Machine ({}{restricted} CPUs: {}; {}) [{}]",
            self.cpus.len(),
            format_cpulist(&ids),
            self.counts(),
            self.source,
        );
        let mut counters = [0usize; 5];
        for child in &root.children {
            self.render(child, 0, &mut counters, &mut out);
        }
        let cpu_nodes: Vec<Option<u32>> = self.cpus.iter().map(|c| c.numa_node).collect();
        for d in &self.devices {
            if d.numa_node.is_none() || !cpu_nodes.contains(&d.numa_node) {
                let _ = writeln!(
                    out,
                    "  {} (no NUMA node among the usable CPUs)",
                    device_label(d)
                );
            }
        }
        out
    }

    fn counts(&self) -> String {
        let plural = |n: usize, what: &str| format!("{n} {what}{}", if n == 1 { "" } else { "s" });
        format!(
            "{}, {}, {}, {}",
            plural(self.package_groups().len(), "package"),
            plural(self.numa_groups().len(), "NUMA node"),
            plural(self.llc_groups().len(), "LLC"),
            plural(self.smt_groups().len(), "core"),
        )
    }

    fn render(&self, node: &TreeNode, depth: usize, counters: &mut [usize; 5], out: &mut String) {
        let c = &self.cpus[node.first];
        let logical = counters[depth];
        counters[depth] += 1;
        let cpus = format_cpulist(&node.cpus);
        let label = match depth {
            0 => format!("Package L#{logical} (P#{}) cpus {cpus}", c.package_id),
            1 => match c.numa_node {
                Some(n) => format!("NUMANode L#{logical} (P#{n}) cpus {cpus}"),
                None => format!("NUMANode L#{logical} (no NUMA information) cpus {cpus}"),
            },
            2 => {
                let llc = &self.llcs[c.llc_id];
                let id = llc
                    .kernel_id
                    .map(|id| format!(" id {id}"))
                    .unwrap_or_default();
                format!("{} L#{logical}{id} cpus {cpus}", llc.name())
            }
            3 => format!("Core L#{logical} (P#{}) cpus {cpus}", c.core_id),
            _ => format!("PU L#{logical} (P#{})", c.cpu),
        };
        let _ = writeln!(out, "{:indent$}{label}", "", indent = 2 * (depth + 1));
        for child in &node.children {
            self.render(child, depth + 1, counters, out);
        }
        if depth == 1 && c.numa_node.is_some() {
            for d in self.devices.iter().filter(|d| d.numa_node == c.numa_node) {
                let _ = writeln!(
                    out,
                    "{:indent$}{}",
                    "",
                    device_label(d),
                    indent = 2 * (depth + 2)
                );
            }
        }
    }
}

/// One line of the tree for a device, in the spirit of lstopo's `PCI`
/// objects: address, kind, ids, and the device files a job would get.
fn device_label(d: &PciDevice) -> String {
    let kind = match d.kind {
        DeviceKind::Gpu => "GPU",
        DeviceKind::Accelerator => "Accelerator",
        DeviceKind::Nic => "NIC",
    };
    let mut label = format!("PCI {} {kind} {:04x}:{:04x}", d.address, d.vendor, d.device);
    if let Some(minor) = d.nvidia_minor {
        let _ = write!(label, " /dev/nvidia{minor}");
    }
    for card in &d.drm_cards {
        let _ = write!(label, " {card}");
    }
    label
}

#[derive(Default)]
struct TreeNode {
    key: u64,
    /// Index in `cpus` of the first CPU of this object (labels come from it).
    first: usize,
    cpus: Vec<u32>,
    children: Vec<TreeNode>,
}

/// A machine described by an engine spec string
/// ([`sched::topology::TopoSpec`], e.g. `"2s:22c:2t"`,
/// `"4s:10c:8t:linear"`), numbered exactly as the engine numbers it, in the
/// same shape as a discovered one: the JSON summary, the tree and
/// [`MachineTopology::to_sched`] work alike. Caches are implied L3s; NUMA
/// node ids are dense.
pub fn synthetic(spec: &str) -> Result<MachineTopology> {
    let bad = |reason: &str| DiscoveryError::Synthetic {
        spec: spec.to_string(),
        reason: reason.to_string(),
    };
    let parsed = TopoSpec::parse(spec)?;
    let n = parsed.nr_leaves().ok_or_else(|| bad("too many CPUs"))?;
    if n > MAX_CPU_ID as usize + 1 {
        return Err(bad(&format!(
            "{n} CPUs is more than {}",
            MAX_CPU_ID as usize + 1
        )));
    }
    let spec_cpus = parsed
        .machine_cpus()
        .ok_or_else(|| bad("a cluster spec describes nodes, not CPUs"))?;
    let mut llc_index: HashMap<usize, usize> = HashMap::new();
    let mut llcs: Vec<CacheInfo> = Vec::new();
    let mut cpus = Vec::with_capacity(n);
    for (cpu, c) in spec_cpus.iter().enumerate() {
        let llc_id = *llc_index.entry(c.llc).or_insert_with(|| {
            llcs.push(CacheInfo {
                level: 3,
                kind: CacheKind::Unified,
                kernel_id: Some(c.llc as u64),
                shared_cpus: Vec::new(),
            });
            llcs.len() - 1
        });
        llcs[llc_id].shared_cpus.push(cpu as u32);
        cpus.push(CpuInfo {
            cpu: cpu as u32,
            core_id: c.core_in_socket as u32,
            die_id: None,
            package_id: c.socket as u32,
            cluster_id: None,
            numa_node: Some(c.numa as u32),
            llc_id,
            smt_siblings: c.smt_siblings.iter().map(|&s| s as u32).collect(),
        });
    }
    Ok(MachineTopology {
        source: format!("synthetic {spec}"),
        online: (0..n as u32).collect(),
        allowed: None,
        cpus,
        llcs,
        devices: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn cpulist_parses_kernel_forms() {
        assert_eq!(
            parse_cpulist("0-3,8,10-11\n"),
            Ok(vec![0, 1, 2, 3, 8, 10, 11])
        );
        assert_eq!(parse_cpulist(""), Ok(vec![]));
        assert_eq!(parse_cpulist("\n"), Ok(vec![]));
        assert_eq!(parse_cpulist("5"), Ok(vec![5]));
        assert_eq!(parse_cpulist(" 3 , 1-2 "), Ok(vec![1, 2, 3]));
        assert_eq!(parse_cpulist("0-3,2-5"), Ok(vec![0, 1, 2, 3, 4, 5]));
        assert_eq!(
            parse_cpulist("0-15:2/4"),
            Ok(vec![0, 1, 4, 5, 8, 9, 12, 13])
        );
        assert_eq!(parse_cpulist("64,0,127"), Ok(vec![0, 64, 127]));
    }

    #[test]
    fn cpulist_errors_say_where() {
        assert_eq!(
            parse_cpulist("0,,2"),
            Err(CpulistError::EmptyItem { pos: 2 })
        );
        assert_eq!(
            parse_cpulist("0-3,"),
            Err(CpulistError::EmptyItem { pos: 4 })
        );
        assert_eq!(
            parse_cpulist("0-3,x"),
            Err(CpulistError::BadNumber {
                text: "x".to_string(),
                pos: 4
            })
        );
        assert!(matches!(
            parse_cpulist("1-"),
            Err(CpulistError::BadNumber { pos: 0, .. })
        ));
        assert!(matches!(
            parse_cpulist("-1"),
            Err(CpulistError::BadNumber { .. })
        ));
        assert!(matches!(
            parse_cpulist("+1"),
            Err(CpulistError::BadNumber { .. })
        ));
        assert_eq!(
            parse_cpulist("7-3"),
            Err(CpulistError::Reversed {
                lo: 7,
                hi: 3,
                pos: 0
            })
        );
        assert_eq!(
            parse_cpulist("0-99999999999999999999999"),
            Err(CpulistError::TooLarge { cpu: u64::MAX })
        );
        assert!(matches!(
            parse_cpulist("4294967295"),
            Err(CpulistError::TooLarge { .. })
        ));
        assert!(matches!(
            parse_cpulist("0-7:0/4"),
            Err(CpulistError::BadStride { .. })
        ));
        assert!(matches!(
            parse_cpulist("0-7:5/4"),
            Err(CpulistError::BadStride { .. })
        ));
        assert!(matches!(
            parse_cpulist("0-7:2"),
            Err(CpulistError::BadStride { .. })
        ));
        let msg = parse_cpulist("0-3,zz").unwrap_err().to_string();
        assert!(msg.contains("\"zz\"") && msg.contains("byte 4"), "{msg}");
    }

    #[test]
    fn cpulist_formats_ranges() {
        assert_eq!(format_cpulist(&[0, 1, 2, 3, 8, 10, 11]), "0-3,8,10-11");
        assert_eq!(format_cpulist(&[]), "");
        assert_eq!(format_cpulist(&[44, 0, 44]), "0,44");
        assert_eq!(
            format_cpulist(&[u32::MAX - 1, u32::MAX]),
            "4294967294-4294967295"
        );
    }

    proptest! {
        #[test]
        fn cpulist_round_trips(set in proptest::collection::btree_set(0u32..2048, 0..300)) {
            let cpus: Vec<u32> = set.into_iter().collect();
            let text = format_cpulist(&cpus);
            prop_assert_eq!(parse_cpulist(&text), Ok(cpus.clone()));
            // Formatting is canonical: a second round gives the same text.
            prop_assert_eq!(format_cpulist(&parse_cpulist(&text).unwrap_or_default()), text);
        }

        #[test]
        fn cpulist_parser_never_panics(text in "[0-9,:/ \\-]{0,40}") {
            if let Ok(cpus) = parse_cpulist(&text) {
                prop_assert!(cpus.windows(2).all(|w| w[0] < w[1]));
            }
        }

        /// Ranges and strides (word-aligned or not, across words, up to
        /// the largest id) give the CPUs a per-CPU brute force names.
        #[test]
        fn cpulist_matches_brute_force(
            items in proptest::collection::vec(
                (0u32..700, 0u32..300, proptest::option::of((1u32..6, 1u32..9))),
                1..6,
            ),
            near_top in any::<bool>(),
        ) {
            let shift = if near_top { MAX_CPU_ID - 1000 } else { 0 };
            let mut text = Vec::new();
            let mut want = std::collections::BTreeSet::new();
            for &(lo, len, stride) in &items {
                let (lo, hi) = (lo + shift, lo + shift + len);
                let mut item = format!("{lo}-{hi}");
                let (used, group) = match stride {
                    Some((u, g)) if u <= g => {
                        item += &format!(":{u}/{g}");
                        (u, g)
                    }
                    _ => (1, 1),
                };
                for cpu in lo..=hi {
                    if (cpu - lo) % group < used {
                        want.insert(cpu);
                    }
                }
                text.push(item);
            }
            let want: Vec<u32> = want.into_iter().collect();
            prop_assert_eq!(parse_cpulist(&text.join(",")), Ok(want));
        }
    }

    /// NUMA lists are read for the usable CPUs: one in two nodes is an
    /// error naming the file, a list naming CPUs that are not usable (a
    /// corrupt one naming a million) is not.
    #[test]
    fn numa_lists_are_read_for_the_usable_cpus() {
        let mut t = SysfsTree::new();
        let sys = "sys/devices/system";
        t.file(format!("{sys}/cpu/online"), "0-1\n");
        for cpu in 0..2 {
            let topo = format!("{sys}/cpu/cpu{cpu}/topology");
            t.file(format!("{topo}/core_id"), format!("{cpu}\n"))
                .file(format!("{topo}/physical_package_id"), "0\n")
                .file(format!("{topo}/core_cpus_list"), format!("{cpu}\n"));
        }
        t.file(format!("{sys}/node/node0/cpulist"), "0,5-1048575\n")
            .file(format!("{sys}/node/node1/cpulist"), "1,5-9\n");
        let m = SysfsReader::in_memory("/t", t.clone()).read(None).unwrap();
        let nodes: Vec<Option<u32>> = m.cpus.iter().map(|c| c.numa_node).collect();
        assert_eq!(nodes, [Some(0), Some(1)]);
        t.file(format!("{sys}/node/node1/cpulist"), "0-1\n");
        let err = SysfsReader::in_memory("/t", t).read(None).unwrap_err();
        assert_eq!(
            err.to_string(),
            "/t/sys/devices/system/node/node1/cpulist: CPU 0 is also in node 0"
        );
    }

    #[test]
    fn llc_choice() {
        use CacheKind::*;
        // x86: L1d, L1i (not offered), L2, L3.
        assert_eq!(pick_llc([(1, Data), (2, Unified), (3, Unified)]), Some(2));
        // POWER10 / Arm: L2 is the highest.
        assert_eq!(pick_llc([(1, Data), (2, Unified)]), Some(1));
        // Only data caches listed.
        assert_eq!(pick_llc([(1, Data), (2, Data)]), Some(1));
        // A unified cache beats a higher data cache.
        assert_eq!(pick_llc([(2, Unified), (3, Data)]), Some(0));
        // Ties keep the first.
        assert_eq!(pick_llc([(3, Unified), (3, Unified)]), Some(0));
        assert_eq!(pick_llc([(1, Unknown)]), None);
        assert_eq!(pick_llc([]), None);
    }

    #[test]
    fn numbered_names() {
        assert_eq!(numbered("node12", "node"), Some(12));
        assert_eq!(numbered("node", "node"), None);
        assert_eq!(numbered("nodes", "node"), None);
        assert_eq!(numbered("cpufreq", "cpu"), None);
        assert_eq!(numbered("index3", "index"), Some(3));
    }

    /// The synthetic machine builds the same tree as the engine's spec.
    #[test]
    fn synthetic_matches_engine_spec() {
        for spec in [
            "2s:22c:2t",
            "1s:10c:2t",
            "4s:10c:8t:linear",
            "2s:8c:2t:llc=4:numa=2",
            "1s:4c",
            "1s:1c",
        ] {
            let m = synthetic(spec).expect(spec);
            let ours = m.to_sched().expect(spec);
            let engine = Topology::from_spec(spec).expect(spec);
            assert_eq!(ours.nr_leaves(), engine.nr_leaves(), "{spec}");
            assert_eq!(ours.nr_numa(), engine.nr_numa(), "{spec}");
            assert_eq!(ours.llcs().len(), engine.llcs().len(), "{spec}");
            for leaf in 0..engine.nr_leaves() {
                assert_eq!(ours.os_id(leaf), engine.os_id(leaf), "{spec}");
                assert_eq!(
                    ours.smt_siblings(leaf),
                    engine.smt_siblings(leaf),
                    "{spec} leaf {leaf}"
                );
                assert_eq!(
                    ours.llcs()[ours.llc_of(leaf)].members,
                    engine.llcs()[engine.llc_of(leaf)].members
                );
                assert_eq!(
                    ours.numa_of(leaf),
                    engine.numa_of(leaf),
                    "{spec} leaf {leaf}"
                );
            }
        }
    }

    #[test]
    fn synthetic_shape_and_errors() {
        let m = synthetic("2s:22c:2t").expect("spec");
        let s = m.summary();
        assert_eq!(s.cpus.len(), 88);
        assert_eq!(s.smt[0], vec![0, 44]);
        assert_eq!(s.llc.len(), 2);
        assert_eq!(s.numa_ids, vec![Some(0), Some(1)]);
        assert!(matches!(
            synthetic("2z:4r:8n"),
            Err(DiscoveryError::Synthetic { .. })
        ));
        assert!(matches!(synthetic("2s:0c"), Err(DiscoveryError::Sched(_))));
        // Refused by the spec parser itself (more leaves than it allows).
        assert!(matches!(
            synthetic("100000s:100000c:100000t"),
            Err(DiscoveryError::Sched(_))
        ));
    }

    #[test]
    fn tree_lists_every_cpu_once() {
        let m = synthetic("2s:2c:2t").expect("spec");
        let tree = m.tree();
        assert_eq!(
            tree.lines()
                .filter(|l| l.trim_start().starts_with("PU "))
                .count(),
            8
        );
        assert!(
            tree.starts_with("Machine (8 CPUs: 0-7; 2 packages, 2 NUMA nodes, 2 LLCs, 4 cores)")
        );
        let lines: Vec<&str> = tree.lines().collect();
        assert_eq!(lines[1], "  Package L#0 (P#0) cpus 0-1,4-5");
        assert_eq!(lines[2], "    NUMANode L#0 (P#0) cpus 0-1,4-5");
        assert_eq!(lines[3], "      L3 L#0 id 0 cpus 0-1,4-5");
        assert_eq!(lines[4], "        Core L#0 (P#0) cpus 0,4");
        assert_eq!(lines[5], "          PU L#0 (P#0)");
        assert_eq!(lines[6], "          PU L#1 (P#4)");
    }
}
