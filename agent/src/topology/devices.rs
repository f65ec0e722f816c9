//! PCI devices as leaves of the machine's topology: this module owns
//! finding the GPUs, other accelerators and network adapters of a machine,
//! and where each sits: its NUMA node, the CPUs local to it, and its path
//! through the PCIe tree (which host bridge, which switches).
//!
//! It reads through the parent module's [`SysfsReader`] (its root, on disk
//! or in memory), like the CPU discovery, so a captured tree of another
//! machine reads exactly like the live one. What is read, for each entry of `<root>/sys/bus/pci/devices/`:
//!
//! * `class`, `vendor`, `device`: what the device is. A GPU is a display
//!   controller (class `0x03xxxx`) of a GPU vendor (NVIDIA `0x10de`, AMD
//!   `0x1002`, Intel `0x8086`); the VGA function of a server's BMC (ASPEED,
//!   Matrox) is a display controller too, and is not a GPU. Other
//!   accelerators are processing accelerators (`0x12xxxx`). Network
//!   adapters are Ethernet (`0x0200xx`) and InfiniBand (`0x0207xx`)
//!   controllers; SR-IOV virtual functions (they have a `physfn` link) are
//!   left out, as `nvidia-smi topo` and Slurm's GRES autodetection do.
//! * `numa_node`: the device's NUMA node, `-1` when the firmware does not
//!   say; then the node is taken from `local_cpulist` when all of those CPUs
//!   lie in one node.
//! * `local_cpulist`: the CPUs the kernel calls local to the device.
//! * the entry's link target (`../../../devices/pci0000:00/0000:00:03.0/
//!   0000:04:00.0/0000:05:08.0/0000:06:00.0`): the host bridge and the
//!   bridges above the device, from which [`PcieLink`] is computed: the
//!   distance `nvidia-smi topo -m` prints (PIX, PXB, PHB, NODE, SYS).
//! * for NVIDIA devices, `<root>/proc/driver/nvidia/gpus/<address>/
//!   information`'s `Device Minor` (the `N` of `/dev/nvidiaN`), when the
//!   driver is loaded; `drm/card*` names for the DRM devices.
//!
//! A machine without `/sys/bus/pci` (a container without it, a captured
//! tree of CPUs only) has no devices; that is not an error. A device whose
//! `class` or `vendor` cannot be parsed is an error naming the file.

use std::path::Path;

use serde::{Deserialize, Serialize};

use super::{DiscoveryError, Result, SysfsReader, parse_cpulist_at};

/// PCI vendor id of NVIDIA.
pub const VENDOR_NVIDIA: u16 = 0x10de;
/// PCI vendor id of AMD (ATI).
pub const VENDOR_AMD: u16 = 0x1002;
/// PCI vendor id of Intel.
pub const VENDOR_INTEL: u16 = 0x8086;

/// What a device is, as far as placement cares.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    /// A GPU: a display controller of a GPU vendor.
    Gpu,
    /// Another processing accelerator (class `0x12`).
    Accelerator,
    /// An Ethernet or InfiniBand adapter (physical function).
    Nic,
}

impl DeviceKind {
    /// The kind of a device from its class code and vendor; `None` for a
    /// device placement does not care about (bridges, disks, a BMC's VGA).
    pub fn classify(class: u32, vendor: u16) -> Option<Self> {
        let base = (class >> 16) as u8;
        let sub = (class >> 8) as u8;
        match (base, sub) {
            (0x03, _) if matches!(vendor, VENDOR_NVIDIA | VENDOR_AMD | VENDOR_INTEL) => {
                Some(Self::Gpu)
            }
            (0x12, _) => Some(Self::Accelerator),
            (0x02, 0x00) | (0x02, 0x07) => Some(Self::Nic),
            _ => None,
        }
    }
}

/// One device, with where it sits in the machine.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PciDevice {
    /// The PCI address, `domain:bus:device.function` ("0000:3b:00.0").
    pub address: String,
    /// What it is.
    pub kind: DeviceKind,
    /// The 24-bit class code.
    pub class: u32,
    /// The vendor id.
    pub vendor: u16,
    /// The device id.
    pub device: u16,
    /// The device's NUMA node: `numa_node`, else the one node holding all of
    /// its local CPUs; `None` when neither says.
    pub numa_node: Option<u32>,
    /// The usable CPUs local to the device (`local_cpulist` restricted to
    /// the usable CPUs), ascending.
    pub local_cpus: Vec<u32>,
    /// The host bridge ("pci0000:00") the device hangs under.
    pub host_bridge: String,
    /// The bridges between the host bridge and the device, outermost first
    /// (the root port, then switch ports).
    pub bridges: Vec<String>,
    /// For an NVIDIA GPU with the driver loaded, the minor number of its
    /// `/dev/nvidiaN`.
    pub nvidia_minor: Option<u32>,
    /// The DRM cards of the device ("card1"), sorted.
    pub drm_cards: Vec<String>,
    /// The `major:minor` numbers of the device's DRM nodes (`card*` and
    /// `renderD*`, from their `dev` files), sorted.
    #[serde(default)]
    pub drm_devs: Vec<(u32, u32)>,
}

/// How directly two devices reach each other over PCIe, best first, in
/// the terms of `nvidia-smi topo -m`. NVLink is not visible in sysfs and
/// is not modelled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum PcieLink {
    /// Through at most one PCIe switch (or one card's functions).
    Pix,
    /// Through several PCIe bridges, without the host bridge.
    Pxb,
    /// Through one host bridge (the same root complex).
    Phb,
    /// Across host bridges within one NUMA node.
    Node,
    /// Across NUMA nodes (the socket interconnect).
    Sys,
}

/// The major number of `/dev/nvidiaN` (the NVIDIA driver's fixed one).
pub const NVIDIA_MAJOR: u32 = 195;

/// A sysfs `dev` file's "major:minor".
pub fn parse_dev_numbers(text: &str) -> Option<(u32, u32)> {
    let (major, minor) = text.trim().split_once(':')?;
    Some((major.parse().ok()?, minor.parse().ok()?))
}

impl PciDevice {
    /// The character device nodes that open this device: `/dev/nvidiaN`
    /// of an NVIDIA GPU and the device's DRM nodes. A job holding the
    /// device may open them; the agent denies them to every other job.
    pub fn char_devices(&self) -> Vec<(u32, u32)> {
        let mut nodes: Vec<(u32, u32)> = self
            .nvidia_minor
            .map(|m| (NVIDIA_MAJOR, m))
            .into_iter()
            .chain(self.drm_devs.iter().copied())
            .collect();
        nodes.sort_unstable();
        nodes.dedup();
        nodes
    }

    /// How this device reaches `other`. Under one host bridge, the bridge
    /// paths are compared: devices that share a bridge and sit at most one
    /// bridge below the last shared one (the ports of one switch, the
    /// functions of one card) are PIX; deeper trees below a shared bridge
    /// are PXB; sharing nothing but the host bridge is PHB.
    pub fn link_to(&self, other: &PciDevice) -> PcieLink {
        if self.host_bridge == other.host_bridge {
            let common = self
                .bridges
                .iter()
                .zip(&other.bridges)
                .take_while(|(a, b)| a == b)
                .count();
            let below = |d: &PciDevice| d.bridges.len() - common;
            return if common == 0 {
                PcieLink::Phb
            } else if below(self) <= 1 && below(other) <= 1 {
                PcieLink::Pix
            } else {
                PcieLink::Pxb
            };
        }
        match (self.numa_node, other.numa_node) {
            (Some(a), Some(b)) if a == b => PcieLink::Node,
            _ => PcieLink::Sys,
        }
    }
}

/// The GPUs of `devices` as leaves of a tree for
/// [`sched::devices::choose_devices`]: each GPU's path of keys, innermost
/// first: the PCIe bridge directly above it (its switch port's switch),
/// its host bridge, its NUMA node, the machine. Keys are interned per level
/// so equal keys mean the same bridge. Returns the GPUs' indices in
/// `devices` and their paths, in the same order.
pub fn gpu_tree(devices: &[PciDevice]) -> (Vec<usize>, Vec<Vec<u64>>) {
    let mut interned: Vec<Vec<String>> = vec![Vec::new(); 3];
    let mut intern = |level: usize, name: String| -> u64 {
        let names = &mut interned[level];
        match names.iter().position(|n| *n == name) {
            Some(i) => i as u64,
            None => {
                names.push(name);
                (names.len() - 1) as u64
            }
        }
    };
    let mut index = Vec::new();
    let mut keys = Vec::new();
    for (i, d) in devices.iter().enumerate() {
        if d.kind != DeviceKind::Gpu {
            continue;
        }
        // The switch: the bridge above the downstream port the GPU hangs
        // from (a GPU directly under a root port is alone at this level).
        let switch = match d.bridges.len() {
            0 | 1 => format!("{}/{}", d.host_bridge, d.address),
            n => format!("{}/{}", d.host_bridge, d.bridges[n - 2]),
        };
        let numa = d.numa_node.map_or(u64::MAX, u64::from);
        keys.push(vec![
            intern(0, switch),
            intern(1, d.host_bridge.clone()),
            numa,
            0,
        ]);
        index.push(i);
    }
    (index, keys)
}

/// Parse a hexadecimal sysfs attribute ("0x030200\n").
pub fn parse_sysfs_hex(text: &str) -> Option<u32> {
    let t = text.trim();
    let digits = t.strip_prefix("0x").or_else(|| t.strip_prefix("0X"))?;
    u32::from_str_radix(digits, 16).ok()
}

fn read_hex(reader: &SysfsReader, path: &Path) -> Result<u32> {
    let text = reader.read_string(path)?;
    parse_sysfs_hex(&text).ok_or_else(|| DiscoveryError::BadInt {
        path: path.to_path_buf(),
        text: text.trim().to_string(),
    })
}

/// Whether `name` looks like a PCI address `dddd:bb:dd.f`.
fn is_pci_address(name: &str) -> bool {
    let b = name.as_bytes();
    b.len() == 12
        && b[4] == b':'
        && b[7] == b':'
        && b[10] == b'.'
        && b.iter()
            .enumerate()
            .all(|(i, c)| matches!(i, 4 | 7 | 10) || c.is_ascii_hexdigit())
}

/// The host bridge and the bridges above `address`, from the target of its
/// `/sys/bus/pci/devices` link.
fn pcie_path(target: &Path, address: &str) -> Option<(String, Vec<String>)> {
    let parts: Vec<&str> = target
        .components()
        .filter_map(|c| c.as_os_str().to_str())
        .collect();
    let host = parts.iter().position(|p| p.starts_with("pci"))?;
    let mut bridges: Vec<String> = parts[host + 1..]
        .iter()
        .filter(|p| is_pci_address(p))
        .map(|p| p.to_string())
        .collect();
    if bridges.last().map(String::as_str) != Some(address) {
        return None;
    }
    bridges.pop();
    Some((parts[host].to_string(), bridges))
}

/// The `Device Minor` line of the NVIDIA driver's per-GPU information file.
pub fn parse_nvidia_minor(information: &str) -> Option<u32> {
    information.lines().find_map(|line| {
        let (key, value) = line.split_once(':')?;
        (key.trim() == "Device Minor")
            .then(|| value.trim().parse().ok())
            .flatten()
    })
}

impl SysfsReader {
    /// The PCI devices placement cares about, sorted by PCI address (the
    /// order `CUDA_DEVICE_ORDER=PCI_BUS_ID` numbers GPUs in). `usable`
    /// (ascending) restricts each device's local CPUs; `numa_of` gives the
    /// NUMA node of a usable CPU.
    pub fn read_devices(
        &self,
        usable: &[u32],
        numa_of: impl Fn(u32) -> Option<u32>,
    ) -> Result<Vec<PciDevice>> {
        let dir = self.root().join("sys/bus/pci/devices");
        let Some(entries) = self.list_dir(&dir)? else {
            return Ok(Vec::new());
        };
        let mut names: Vec<String> = entries
            .into_iter()
            .filter_map(|name| name.into_string().ok())
            .filter(|name| is_pci_address(name))
            .collect();
        names.sort();
        let mut devices = Vec::new();
        for address in names {
            let path = dir.join(&address);
            let target = self.read_link(&path)?;
            let (host_bridge, bridges) =
                pcie_path(&target, &address).ok_or_else(|| DiscoveryError::Inconsistent {
                    path: path.clone(),
                    reason: format!(
                        "link target {} is not a path of PCI bridges ending at {address}",
                        target.display()
                    ),
                })?;
            let class = read_hex(self, &path.join("class"))?;
            let vendor = read_hex(self, &path.join("vendor"))? as u16;
            let Some(kind) = DeviceKind::classify(class, vendor) else {
                continue;
            };
            if kind == DeviceKind::Nic && self.exists(&path.join("physfn")) {
                continue;
            }
            let device = read_hex(self, &path.join("device"))? as u16;
            let local_path = path.join("local_cpulist");
            let local_cpus: Vec<u32> = match self.read_optional(&local_path)? {
                Some(text) => parse_cpulist_at(&local_path, &text)?
                    .into_iter()
                    .filter(|c| usable.binary_search(c).is_ok())
                    .collect(),
                None => Vec::new(),
            };
            let numa_node = match self.read_optional_int(&path.join("numa_node"))? {
                Some(n) if n >= 0 => u32::try_from(n).ok(),
                _ => {
                    let mut nodes = local_cpus.iter().map(|&c| numa_of(c));
                    match nodes.next() {
                        Some(first) if nodes.all(|n| n == first) => first,
                        _ => None,
                    }
                }
            };
            let nvidia_minor = if vendor == VENDOR_NVIDIA {
                let info = self
                    .root()
                    .join("proc/driver/nvidia/gpus")
                    .join(&address)
                    .join("information");
                self.read_optional(&info)?
                    .and_then(|t| parse_nvidia_minor(&t))
            } else {
                None
            };
            let drm_dir = path.join("drm");
            let drm_names: Vec<String> = match self.source.list_dir(&self.root, &drm_dir) {
                Ok(names) => names
                    .into_iter()
                    .filter_map(|name| name.into_string().ok())
                    .collect(),
                Err(_) => Vec::new(),
            };
            let numbered = |n: &str, prefix: &str| {
                n.strip_prefix(prefix)
                    .is_some_and(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
            };
            let mut drm_cards: Vec<String> = drm_names
                .iter()
                .filter(|n| numbered(n, "card"))
                .cloned()
                .collect();
            drm_cards.sort();
            // The device numbers of the DRM nodes (card*, renderD*), for the
            // job's device rules; a missing or malformed `dev` is skipped.
            let mut drm_devs = Vec::new();
            for name in drm_names
                .iter()
                .filter(|n| numbered(n, "card") || numbered(n, "renderD"))
            {
                if let Some(text) = self.read_optional(&drm_dir.join(name).join("dev"))?
                    && let Some(numbers) = parse_dev_numbers(&text)
                {
                    drm_devs.push(numbers);
                }
            }
            drm_devs.sort_unstable();
            devices.push(PciDevice {
                address,
                kind,
                class,
                vendor,
                device,
                numa_node,
                local_cpus,
                host_bridge,
                bridges,
                nvidia_minor,
                drm_cards,
                drm_devs,
            });
        }
        Ok(devices)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dev(host: &str, bridges: &[&str], numa: Option<u32>) -> PciDevice {
        PciDevice {
            address: "0000:00:00.0".into(),
            kind: DeviceKind::Gpu,
            class: 0x030200,
            vendor: VENDOR_NVIDIA,
            device: 0x20b0,
            numa_node: numa,
            local_cpus: Vec::new(),
            host_bridge: host.into(),
            bridges: bridges.iter().map(|b| b.to_string()).collect(),
            nvidia_minor: None,
            drm_cards: Vec::new(),
            drm_devs: Vec::new(),
        }
    }

    #[test]
    fn classify_keeps_gpus_accelerators_and_nics_only() {
        assert_eq!(
            DeviceKind::classify(0x030200, VENDOR_NVIDIA),
            Some(DeviceKind::Gpu)
        );
        assert_eq!(
            DeviceKind::classify(0x030000, VENDOR_AMD),
            Some(DeviceKind::Gpu)
        );
        assert_eq!(
            DeviceKind::classify(0x038000, VENDOR_AMD),
            Some(DeviceKind::Gpu)
        );
        // A BMC's VGA (ASPEED) is a display controller but not a GPU.
        assert_eq!(DeviceKind::classify(0x030000, 0x1a03), None);
        assert_eq!(
            DeviceKind::classify(0x120000, 0x1da3),
            Some(DeviceKind::Accelerator)
        );
        assert_eq!(
            DeviceKind::classify(0x020000, 0x15b3),
            Some(DeviceKind::Nic)
        );
        assert_eq!(
            DeviceKind::classify(0x020700, 0x15b3),
            Some(DeviceKind::Nic)
        );
        assert_eq!(DeviceKind::classify(0x020800, 0x15b3), None);
        assert_eq!(DeviceKind::classify(0x010802, VENDOR_INTEL), None, "NVMe");
        assert_eq!(DeviceKind::classify(0x060400, VENDOR_INTEL), None, "bridge");
    }

    #[test]
    fn hex_and_minor_parsing() {
        assert_eq!(parse_sysfs_hex("0x030200\n"), Some(0x030200));
        assert_eq!(parse_sysfs_hex("0x10de"), Some(0x10de));
        assert_eq!(parse_sysfs_hex("10de"), None);
        assert_eq!(parse_sysfs_hex("0xzz"), None);
        let info = "Model: \t\t NVIDIA A100\nIRQ:   \t\t 150\nDevice Minor: \t 3\nBus Location: \t 0000:3b:00.0\n";
        assert_eq!(parse_nvidia_minor(info), Some(3));
        assert_eq!(parse_nvidia_minor("Model: x\n"), None);
    }

    #[test]
    fn pcie_paths_and_links() {
        let t = Path::new(
            "../../../devices/pci0000:00/0000:00:03.0/0000:04:00.0/0000:05:08.0/0000:06:00.0",
        );
        let (host, bridges) = pcie_path(t, "0000:06:00.0").unwrap();
        assert_eq!(host, "pci0000:00");
        assert_eq!(bridges, ["0000:00:03.0", "0000:04:00.0", "0000:05:08.0"]);
        assert!(
            pcie_path(t, "0000:07:00.0").is_none(),
            "the path must end at the device"
        );
        assert!(pcie_path(Path::new("../../x"), "0000:06:00.0").is_none());

        let sw = ["0000:00:03.0", "0000:04:00.0", "0000:05:08.0"];
        let sw2 = ["0000:00:03.0", "0000:04:00.0", "0000:05:10.0"];
        let a = dev("pci0000:00", &sw, Some(0));
        assert_eq!(
            a.link_to(&dev("pci0000:00", &sw, Some(0))),
            PcieLink::Pix,
            "one port"
        );
        assert_eq!(
            a.link_to(&dev("pci0000:00", &sw2, Some(0))),
            PcieLink::Pix,
            "one switch"
        );
        // Two levels of switches: the paths part at the first switch and
        // go through a second one each.
        let deep_a = [
            "0000:00:03.0",
            "0000:04:00.0",
            "0000:05:08.0",
            "0000:06:00.0",
            "0000:07:00.0",
        ];
        let deep_b = [
            "0000:00:03.0",
            "0000:04:00.0",
            "0000:05:10.0",
            "0000:08:00.0",
            "0000:09:00.0",
        ];
        let d = dev("pci0000:00", &deep_a, Some(0));
        assert_eq!(
            d.link_to(&dev("pci0000:00", &deep_b, Some(0))),
            PcieLink::Pxb
        );
        assert_eq!(
            a.link_to(&dev("pci0000:00", &["0000:00:01.0"], Some(0))),
            PcieLink::Phb
        );
        assert_eq!(a.link_to(&dev("pci0000:17", &sw, Some(0))), PcieLink::Node);
        assert_eq!(a.link_to(&dev("pci0000:80", &sw, Some(1))), PcieLink::Sys);
        assert_eq!(a.link_to(&dev("pci0000:80", &sw, None)), PcieLink::Sys);
    }

    #[test]
    fn pci_address_shape() {
        assert!(is_pci_address("0000:3b:00.0"));
        assert!(!is_pci_address("pci0000:00"));
        assert!(!is_pci_address("0000:3b:00"));
        assert!(!is_pci_address("0000:3g:00.0"));
    }
}
