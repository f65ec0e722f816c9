//! The GPUs of this machine as the agent hands them to jobs: which GPU
//! each job holds, the choice of `k` free GPUs for a job whose CPUs are
//! placed (on [`sched::devices::choose_devices_near`]: the NUMA nodes of
//! the job's CPUs first, then any, the closest set in each), the
//! environment that tells the job's programs which GPUs are theirs, the
//! API's form of the machine's devices, and the ledger that keeps the
//! holdings across an agent restart.
//!
//! A GPU's *index* is its position among the machine's GPUs in PCI bus
//! order (what [`crate::topology::SysfsReader::read_devices`] returns):
//! the number the dispatcher shows (`Job.gpus`, `Device.index`). The
//! environment of a job holding GPUs:
//!
//! * `CUDA_VISIBLE_DEVICES` and `NVIDIA_VISIBLE_DEVICES`: the job's NVIDIA
//!   GPUs as their positions among the machine's NVIDIA GPUs in PCI bus
//!   order, with `CUDA_DEVICE_ORDER=PCI_BUS_ID` so CUDA numbers them the
//!   same way (its default order is "fastest first"). This is also the
//!   index NVML and `nvidia-smi` print, which the NVIDIA container
//!   runtime reads from `NVIDIA_VISIBLE_DEVICES`. The `/dev/nvidiaN`
//!   minor numbers are *not* used here: they need not follow PCI order
//!   (the 8-GPU fixture's are 2,3,0,1,6,7,4,5) and no CUDA variable takes
//!   them.
//! * `ROCR_VISIBLE_DEVICES`: the job's AMD GPUs as positions among the
//!   machine's AMD GPUs in PCI bus order. ROCm numbers GPUs by the KFD
//!   topology nodes the kernel creates as it probes them; we assume that
//!   is PCI bus order, which no AMD machine here could confirm.
//! * `DISPATCH_GPUS`: the node's GPU indices, whatever the vendor.
//!
//!
//! The variables steer CUDA/ROCm; they do not confine. Where the job has a
//! cgroup v2 and the agent may load BPF programs, its cgroup also denies it
//! the device nodes (`/dev/nvidiaN`, the DRM `card`/`renderD` nodes) of
//! every GPU it does not hold ([`GpuPool::deny_for`],
//! [`crate::exec::devices`]); elsewhere the agent logs that GPUs are not
//! confined. Shared control nodes (`/dev/nvidiactl`, `/dev/nvidia-uvm`,
//! `/dev/kfd`) stay open to all, as the NVIDIA and ROCm container
//! runtimes leave them.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use crate::exec::devices::{DenyList, DeviceNode};
use crate::topology::devices::{VENDOR_AMD, VENDOR_INTEL, VENDOR_NVIDIA, gpu_tree};
use crate::topology::{DeviceKind, MachineTopology, PciDevice};

/// The machine's GPUs and which job holds each.
#[derive(Clone, Debug, Default)]
pub struct GpuPool {
    /// The GPUs in PCI bus order (index = position).
    gpus: Vec<PciDevice>,
    /// Each GPU's locality path (switch, host bridge, NUMA node, machine).
    keys: Vec<Vec<u64>>,
    /// The job holding each GPU.
    holder: Vec<Option<String>>,
    /// NUMA node of each usable CPU.
    numa_of_cpu: HashMap<u32, u32>,
    /// Holdings changed since [`GpuPool::take_changed`].
    changed: bool,
}

impl GpuPool {
    /// The GPUs of `machine` (none for a synthetic one), all free.
    pub fn new(machine: &MachineTopology) -> Self {
        let (index, keys) = gpu_tree(&machine.devices);
        let gpus: Vec<PciDevice> = index.iter().map(|&i| machine.devices[i].clone()).collect();
        Self {
            holder: vec![None; gpus.len()],
            gpus,
            keys,
            numa_of_cpu: machine
                .cpus
                .iter()
                .filter_map(|c| Some((c.cpu, c.numa_node?)))
                .collect(),
            changed: false,
        }
    }

    /// Number of GPUs.
    pub fn len(&self) -> usize {
        self.gpus.len()
    }

    /// True on a machine without GPUs.
    pub fn is_empty(&self) -> bool {
        self.gpus.is_empty()
    }

    /// GPUs no job holds.
    pub fn free(&self) -> usize {
        self.holder.iter().filter(|h| h.is_none()).count()
    }

    /// `k` free GPUs for a job on `cpus`: those on the CPUs' NUMA nodes
    /// first, else any, the closest set in each step. `None` when fewer
    /// than `k` are free.
    pub fn choose(&self, k: usize, cpus: &[u32]) -> Option<Vec<u32>> {
        let nodes: Vec<u32> = cpus
            .iter()
            .filter_map(|c| self.numa_of_cpu.get(c).copied())
            .collect();
        sched::devices::choose_devices_near(
            k,
            &self.keys,
            |i| self.holder[i].is_none(),
            |i| self.gpus[i].numa_node.is_some_and(|n| nodes.contains(&n)),
        )
        .map(|v| v.into_iter().map(|i| i as u32).collect())
    }

    /// Mark `gpus` as held by job `id` (unknown indices are ignored).
    pub fn take(&mut self, id: &str, gpus: &[u32]) {
        for &g in gpus {
            if let Some(h) = self.holder.get_mut(g as usize) {
                *h = Some(id.to_string());
                self.changed = true;
            }
        }
    }

    /// Free the GPUs job `id` holds.
    pub fn release(&mut self, id: &str) {
        for h in &mut self.holder {
            if h.as_deref() == Some(id) {
                *h = None;
                self.changed = true;
            }
        }
    }

    /// The GPUs job `id` holds, ascending.
    pub fn held_by(&self, id: &str) -> Vec<u32> {
        self.holder
            .iter()
            .enumerate()
            .filter(|(_, h)| h.as_deref() == Some(id))
            .map(|(i, _)| i as u32)
            .collect()
    }

    /// Every holding: job id -> its GPUs.
    pub fn holdings(&self) -> BTreeMap<String, Vec<u32>> {
        let mut out: BTreeMap<String, Vec<u32>> = BTreeMap::new();
        for (i, h) in self.holder.iter().enumerate() {
            if let Some(id) = h {
                out.entry(id.clone()).or_default().push(i as u32);
            }
        }
        out
    }

    /// True (once) when holdings changed since the last call.
    pub fn take_changed(&mut self) -> bool {
        std::mem::take(&mut self.changed)
    }

    /// The NUMA node of GPU `index`.
    pub fn numa_node(&self, index: u32) -> Option<u32> {
        self.gpus.get(index as usize).and_then(|g| g.numa_node)
    }

    /// The device nodes of every GPU not in `gpus`: what a job holding
    /// `gpus` may not open (its cgroup's device rules, see
    /// [`crate::exec::devices`]). A job holding no GPU is denied them all.
    pub fn deny_for(&self, gpus: &[u32]) -> DenyList {
        DenyList::new(
            self.gpus
                .iter()
                .enumerate()
                .filter(|(i, _)| !gpus.contains(&(*i as u32)))
                .flat_map(|(_, g)| g.char_devices())
                .map(|(major, minor)| DeviceNode::char(major, minor))
                .collect(),
        )
    }

    /// The environment telling a job's programs its GPUs (see the module
    /// doc); empty for none.
    pub fn env(&self, gpus: &[u32]) -> Vec<(String, String)> {
        if gpus.is_empty() {
            return Vec::new();
        }
        // Position of GPU `g` among the machine's GPUs of its vendor.
        let vendor_index = |g: usize| {
            let v = self.gpus[g].vendor;
            self.gpus[..g].iter().filter(|d| d.vendor == v).count()
        };
        let list = |vendor: u16| -> Vec<String> {
            gpus.iter()
                .map(|&g| g as usize)
                .filter(|&g| self.gpus.get(g).is_some_and(|d| d.vendor == vendor))
                .map(|g| vendor_index(g).to_string())
                .collect()
        };
        let mut env = vec![(
            "DISPATCH_GPUS".to_string(),
            gpus.iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(","),
        )];
        let nvidia = list(VENDOR_NVIDIA);
        if !nvidia.is_empty() {
            let ids = nvidia.join(",");
            env.push(("CUDA_DEVICE_ORDER".into(), "PCI_BUS_ID".into()));
            env.push(("CUDA_VISIBLE_DEVICES".into(), ids.clone()));
            env.push(("NVIDIA_VISIBLE_DEVICES".into(), ids));
        }
        let amd = list(VENDOR_AMD);
        if !amd.is_empty() {
            env.push(("ROCR_VISIBLE_DEVICES".into(), amd.join(",")));
        }
        env
    }
}

/// A vendor's name for the API ("nvidia"), else its id in hex.
fn vendor_name(vendor: u16) -> String {
    match vendor {
        VENDOR_NVIDIA => "nvidia".into(),
        VENDOR_AMD => "amd".into(),
        VENDOR_INTEL => "intel".into(),
        v => format!("{v:04x}"),
    }
}

/// The API's form of the machine's devices: each with its index among the
/// devices of its kind (PCI bus order) and, for GPUs, its locality path.
pub fn devices_proto(devices: &[PciDevice]) -> Vec<proto::v1::Device> {
    let (gpu_index, keys) = gpu_tree(devices);
    let mut counts: HashMap<DeviceKind, u32> = HashMap::new();
    devices
        .iter()
        .enumerate()
        .map(|(i, d)| {
            let n = counts.entry(d.kind).or_default();
            let index = *n;
            *n += 1;
            let kind = match d.kind {
                DeviceKind::Gpu => proto::v1::DeviceKind::Gpu,
                DeviceKind::Accelerator => proto::v1::DeviceKind::Accelerator,
                DeviceKind::Nic => proto::v1::DeviceKind::Nic,
            };
            proto::v1::Device {
                kind: kind as i32,
                index,
                pci_address: d.address.clone(),
                numa_node: d.numa_node,
                vendor_id: u32::from(d.vendor),
                device_id: u32::from(d.device),
                vendor: vendor_name(d.vendor),
                model: format!("{:04x}:{:04x}", d.vendor, d.device),
                host_bridge: d.host_bridge.clone(),
                bridges: d.bridges.clone(),
                locality: gpu_index
                    .iter()
                    .position(|&g| g == i)
                    .map_or(Vec::new(), |p| keys[p].clone()),
                nvidia_minor: d.nvidia_minor,
            }
        })
        .collect()
}

/// The GPU holdings on disk (`<state dir>/gpus.json`, job id -> indices),
/// so an agent restarted on the same state directory knows which GPUs its
/// re-adopted jobs hold. Rewritten whole (temporary file, rename) when the
/// holdings change; unreadable means empty, with a warning.
#[derive(Clone, Debug)]
pub struct Ledger {
    path: PathBuf,
}

impl Ledger {
    /// The ledger of the state directory `dir`.
    pub fn new(dir: &Path) -> Self {
        Self {
            path: dir.join("gpus.json"),
        }
    }

    /// The holdings last saved.
    pub fn load(&self) -> BTreeMap<String, Vec<u32>> {
        match std::fs::read(&self.path) {
            Ok(bytes) => serde_json::from_slice(&bytes).unwrap_or_else(|err| {
                tracing::warn!(path = %self.path.display(), %err, "unreadable GPU ledger; ignored");
                BTreeMap::new()
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => BTreeMap::new(),
            Err(err) => {
                tracing::warn!(path = %self.path.display(), %err, "cannot read the GPU ledger");
                BTreeMap::new()
            }
        }
    }

    /// Save `holdings`.
    pub fn save(&self, holdings: &BTreeMap<String, Vec<u32>>) -> std::io::Result<()> {
        let tmp = self.path.with_extension("json.tmp");
        let bytes = serde_json::to_vec(holdings).map_err(std::io::Error::other)?;
        std::fs::write(&tmp, bytes)?;
        std::fs::rename(&tmp, &self.path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn fixture() -> MachineTopology {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/x6-2-8gpu");
        crate::topology::SysfsReader::new(root)
            .read(None)
            .expect("read x6-2-8gpu")
    }

    /// Socket 1's CPUs on the X6-2: cores 22-43 and their siblings 66-87.
    fn socket1() -> Vec<u32> {
        (22..44).chain(66..88).collect()
    }

    #[test]
    fn choice_prefers_the_cpus_numa_node_then_the_closest_anywhere() {
        let mut pool = GpuPool::new(&fixture());
        assert_eq!(pool.len(), 8);
        // CPUs on socket 1 (NUMA node 1): its first switch, GPUs 4-5.
        assert_eq!(pool.choose(2, &[22, 23]), Some(vec![4, 5]));
        // On socket 0: GPUs 0-1.
        assert_eq!(pool.choose(2, &[0, 44]), Some(vec![0, 1]));
        // Node 1 full but one GPU: two GPUs of one switch of node 0, not
        // the near one and a far one.
        pool.take("a", &[4, 5, 6]);
        assert_eq!(pool.choose(2, &socket1()), Some(vec![0, 1]));
        assert_eq!(pool.choose(1, &socket1()), Some(vec![7]), "near first");
        pool.take("b", &[0, 1, 2, 3, 7]);
        assert_eq!(pool.free(), 0);
        assert_eq!(pool.choose(1, &[0]), None);
        assert_eq!(pool.held_by("a"), vec![4, 5, 6]);
        pool.release("a");
        assert_eq!(pool.free(), 3);
        assert_eq!(pool.choose(3, &[0]), Some(vec![4, 5, 6]));
        assert!(pool.take_changed());
        assert!(!pool.take_changed());
    }

    #[test]
    fn a_job_is_denied_the_nodes_of_every_gpu_it_does_not_hold() {
        let pool = GpuPool::new(&fixture());
        // The fixture's /dev/nvidiaN minors in PCI order, and its DRM
        // cards (sys/devices/.../drm/cardN/dev, "226:N", N = 1..8 in PCI
        // order), read from the fixture's files, not from the pool.
        let minors = [2u32, 3, 0, 1, 6, 7, 4, 5];
        let nodes_of = |g: usize| {
            vec![
                DeviceNode::char(195, minors[g]),
                DeviceNode::char(226, g as u32 + 1),
            ]
        };
        let all: Vec<DeviceNode> = (0..8).flat_map(nodes_of).collect();
        assert_eq!(pool.deny_for(&[]), DenyList::new(all.clone()));
        assert!(pool.deny_for(&(0..8).collect::<Vec<_>>()).is_empty());
        let deny = pool.deny_for(&[4, 5]);
        let want: Vec<DeviceNode> = (0..8)
            .filter(|g| ![4, 5].contains(g))
            .flat_map(nodes_of)
            .collect();
        assert_eq!(deny, DenyList::new(want));
    }

    #[test]
    fn environment_uses_vendor_indices_in_pci_order() {
        let pool = GpuPool::new(&fixture());
        let env: HashMap<String, String> = pool.env(&[4, 5]).into_iter().collect();
        assert_eq!(env["CUDA_VISIBLE_DEVICES"], "4,5");
        assert_eq!(env["NVIDIA_VISIBLE_DEVICES"], "4,5");
        assert_eq!(env["CUDA_DEVICE_ORDER"], "PCI_BUS_ID");
        assert_eq!(env["DISPATCH_GPUS"], "4,5");
        assert!(!env.contains_key("ROCR_VISIBLE_DEVICES"));
        assert!(pool.env(&[]).is_empty());

        // A machine with an AMD GPU between two NVIDIA ones: each vendor's
        // variable counts its own GPUs.
        let mut m = fixture();
        for (n, d) in m
            .devices
            .iter_mut()
            .filter(|d| d.kind == DeviceKind::Gpu)
            .enumerate()
        {
            if n == 1 {
                d.vendor = VENDOR_AMD;
            }
        }
        let pool = GpuPool::new(&m);
        let env: HashMap<String, String> = pool.env(&[0, 1, 2]).into_iter().collect();
        assert_eq!(env["CUDA_VISIBLE_DEVICES"], "0,1");
        assert_eq!(env["ROCR_VISIBLE_DEVICES"], "0");
        assert_eq!(env["DISPATCH_GPUS"], "0,1,2");
    }

    #[test]
    fn devices_in_the_api_carry_index_numa_and_locality() {
        let m = fixture();
        let devs = devices_proto(&m.devices);
        let gpus: Vec<&proto::v1::Device> = devs
            .iter()
            .filter(|d| d.kind == proto::v1::DeviceKind::Gpu as i32)
            .collect();
        assert_eq!(gpus.len(), 8);
        for (i, g) in gpus.iter().enumerate() {
            assert_eq!(g.index, i as u32);
            assert_eq!(g.numa_node, Some(i as u32 / 4));
            assert_eq!(g.vendor, "nvidia");
            assert_eq!(g.model, "10de:20b0");
            assert_eq!(g.locality.len(), 4);
        }
        // GPUs 0 and 1 share a switch; 0 and 2 only the NUMA node.
        assert_eq!(gpus[0].locality, gpus[1].locality);
        assert_ne!(gpus[0].locality[1], gpus[2].locality[1]);
        assert_eq!(gpus[0].locality[2], gpus[2].locality[2]);
        let nics: Vec<u32> = devs
            .iter()
            .filter(|d| d.kind == proto::v1::DeviceKind::Nic as i32)
            .map(|d| d.index)
            .collect();
        assert_eq!(nics, [0, 1]);
        assert!(
            devs.iter()
                .filter(|d| d.kind == proto::v1::DeviceKind::Nic as i32)
                .all(|d| d.locality.is_empty())
        );
    }

    #[test]
    fn ledger_round_trips_and_tolerates_garbage() {
        let dir = tempfile::tempdir().unwrap();
        let ledger = Ledger::new(dir.path());
        assert!(ledger.load().is_empty());
        let mut h = BTreeMap::new();
        h.insert("j-1_a1".to_string(), vec![4, 5]);
        ledger.save(&h).unwrap();
        assert_eq!(ledger.load(), h);
        std::fs::write(dir.path().join("gpus.json"), b"{not json").unwrap();
        assert!(ledger.load().is_empty());
    }
}
