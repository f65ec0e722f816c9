//! PCI device discovery (GPUs, accelerators, NICs and their place in the
//! machine) against the captured trees `x6-2-8gpu` and `x6-2-nogpu`
//! (written by tests/fixtures/make_fixtures.py), broken trees, and the
//! `agent topology` binary. The expectations are written from the
//! fixture's description, not from the reader.

use std::fs;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::Command;

use agent::topology::{DeviceKind, DiscoveryError, PcieLink, SysfsReader, TopologySummary};

fn fixture_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// Socket `s`'s CPUs on the X6-2 (cores 0-21 and their siblings 44-65 are
/// socket 0).
fn socket_cpus(s: u32) -> Vec<u32> {
    (0..88).filter(|c| (c % 44) / 22 == s).collect()
}

#[test]
fn eight_gpu_server_has_its_gpus_nics_and_their_places() {
    let m = SysfsReader::new(fixture_dir("x6-2-8gpu"))
        .read(None)
        .expect("read x6-2-8gpu");
    assert_eq!(m.nr_cpus(), 88, "the CPUs are the X6-2's");
    let gpus: Vec<_> = m
        .devices
        .iter()
        .filter(|d| d.kind == DeviceKind::Gpu)
        .collect();
    let nics: Vec<_> = m
        .devices
        .iter()
        .filter(|d| d.kind == DeviceKind::Nic)
        .collect();
    assert_eq!(
        m.devices.len(),
        10,
        "8 GPUs and 2 NICs; no BMC VGA, NVMe, bridge or VF"
    );
    let addrs: Vec<&str> = gpus.iter().map(|d| d.address.as_str()).collect();
    assert_eq!(
        addrs,
        [
            "0000:1a:00.0",
            "0000:1b:00.0",
            "0000:3d:00.0",
            "0000:3e:00.0",
            "0000:88:00.0",
            "0000:89:00.0",
            "0000:b1:00.0",
            "0000:b2:00.0"
        ],
        "PCI bus order"
    );
    let nic_addrs: Vec<&str> = nics.iter().map(|d| d.address.as_str()).collect();
    assert_eq!(
        nic_addrs,
        ["0000:1c:00.0", "0000:8a:00.0"],
        "the VFs 1c:00.1, 8a:00.1 are left out"
    );
    for (i, g) in gpus.iter().enumerate() {
        let socket = (i / 4) as u32;
        assert_eq!(g.numa_node, Some(socket), "{}: NUMA node", g.address);
        assert_eq!(
            g.local_cpus,
            socket_cpus(socket),
            "{}: local CPUs",
            g.address
        );
        assert_eq!((g.vendor, g.device, g.class), (0x10de, 0x20b0, 0x030200));
        assert_eq!(g.drm_cards, [format!("card{}", i + 1)]);
    }
    // The fixture's minors are [2, 3, 0, 1, 6, 7, 4, 5] in PCI order.
    let minors: Vec<Option<u32>> = gpus.iter().map(|g| g.nvidia_minor).collect();
    let want: Vec<Option<u32>> = [2, 3, 0, 1, 6, 7, 4, 5].into_iter().map(Some).collect();
    assert_eq!(minors, want);
    // b2:00.0 has numa_node -1: its node comes from its local CPUs.
    let b2 = gpus[7];
    assert_eq!(b2.numa_node, Some(1));
    assert_eq!(b2.host_bridge, "pci0000:ae");
    assert_eq!(b2.bridges, ["0000:ae:00.0", "0000:af:00.0", "0000:b0:10.0"]);

    // Links, as nvidia-smi topo -m would print them.
    assert_eq!(gpus[0].link_to(gpus[1]), PcieLink::Pix, "one switch");
    assert_eq!(
        gpus[0].link_to(nics[0]),
        PcieLink::Pix,
        "the GPU and the IB of one switch"
    );
    assert_eq!(
        gpus[0].link_to(gpus[2]),
        PcieLink::Node,
        "two host bridges of one socket"
    );
    assert_eq!(gpus[0].link_to(gpus[4]), PcieLink::Sys, "across sockets");
    assert_eq!(gpus[4].link_to(nics[1]), PcieLink::Pix);
    for a in &m.devices {
        for b in &m.devices {
            assert_eq!(a.link_to(b), b.link_to(a), "{} {}", a.address, b.address);
        }
    }
}

#[test]
fn cpu_restriction_narrows_local_cpus_but_keeps_the_devices() {
    let allowed: Vec<u32> = (0..22).collect();
    let m = SysfsReader::new(fixture_dir("x6-2-8gpu"))
        .read(Some(&allowed))
        .expect("read");
    assert_eq!(m.devices.len(), 10);
    let gpus: Vec<_> = m
        .devices
        .iter()
        .filter(|d| d.kind == DeviceKind::Gpu)
        .collect();
    assert_eq!(gpus[0].local_cpus, allowed);
    assert!(gpus[4].local_cpus.is_empty(), "socket 1 has no usable CPU");
    assert_eq!(gpus[4].numa_node, Some(1), "numa_node is read, not derived");
    // b2:00.0 has no numa_node and no usable local CPU: its node is unknown.
    assert_eq!(gpus[7].numa_node, None);
    assert!(
        m.tree()
            .contains("PCI 0000:b2:00.0 GPU 10de:20b0 /dev/nvidia5 card8 (no NUMA node")
    );
}

#[test]
fn machines_without_gpus_or_without_a_pci_bus() {
    let m = SysfsReader::new(fixture_dir("x6-2-nogpu"))
        .read(None)
        .expect("read x6-2-nogpu");
    let kinds: Vec<(String, DeviceKind)> = m
        .devices
        .iter()
        .map(|d| (d.address.clone(), d.kind))
        .collect();
    assert_eq!(kinds, [("0000:05:00.0".to_string(), DeviceKind::Nic)]);
    let m = SysfsReader::new(fixture_dir("x6-2-88cpu"))
        .read(None)
        .expect("read x6-2-88cpu");
    assert!(m.devices.is_empty(), "no sys/bus/pci: no devices, no error");
}

#[test]
fn tree_shows_gpus_under_their_numa_node() {
    let m = SysfsReader::new(fixture_dir("x6-2-8gpu"))
        .read(None)
        .expect("read");
    let tree = m.tree();
    let node1 = tree.find("NUMANode L#1").expect("node 1 line");
    let gpu0 = tree
        .find("PCI 0000:1a:00.0 GPU 10de:20b0 /dev/nvidia2 card1")
        .expect("gpu0 line");
    let gpu4 = tree.find("PCI 0000:88:00.0 GPU").expect("gpu4 line");
    assert!(gpu0 < node1 && node1 < gpu4, "{tree}");
    assert!(tree.contains("PCI 0000:1c:00.0 NIC 15b3:101b"));
    assert!(!tree.contains("0000:03:00.0"), "the BMC's VGA is not shown");
}

#[test]
fn binary_prints_devices_in_json() {
    let root = fixture_dir("x6-2-8gpu");
    let out = Command::new(env!("CARGO_BIN_EXE_agent"))
        .args(["topology", "--all-cpus", "--json", "--sysfs-root"])
        .arg(&root)
        .output()
        .expect("run agent");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary: TopologySummary = serde_json::from_slice(&out.stdout).expect("summary");
    assert_eq!(summary.devices.len(), 10);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(json["devices"][0]["kind"], "gpu");
    assert_eq!(json["devices"][0]["numa_node"], 0);
    // Without devices the key is absent, so old readers see the old JSON.
    let out = Command::new(env!("CARGO_BIN_EXE_agent"))
        .args(["topology", "--all-cpus", "--json", "--sysfs-root"])
        .arg(fixture_dir("x6-2-88cpu"))
        .output()
        .expect("run agent");
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert!(json.get("devices").is_none());
}

/// A copy of the 8-GPU tree in a temporary directory, to break.
fn copy_tree(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    let status = Command::new("cp")
        .arg("-a")
        .arg(fixture_dir(name).join("sys"))
        .arg(dir.path())
        .status()
        .expect("cp");
    assert!(status.success());
    // The CPUs are a relative link into a sibling fixture; point it back.
    let system = dir.path().join("sys/devices/system");
    fs::remove_file(&system).expect("rm link");
    symlink(
        fixture_dir("x6-2-88cpu").join("sys/devices/system"),
        &system,
    )
    .expect("link");
    dir
}

#[test]
fn broken_device_files_are_errors_naming_the_file() {
    let dir = copy_tree("x6-2-8gpu");
    let class = dir
        .path()
        .join("sys/devices/pci0000:17/0000:17:00.0/0000:18:00.0/0000:19:08.0/0000:1a:00.0/class");
    fs::write(&class, "GPU\n").expect("write");
    match SysfsReader::new(dir.path()).read(None) {
        Err(DiscoveryError::BadInt { path, text }) => {
            assert_eq!(
                path,
                dir.path().join("sys/bus/pci/devices/0000:1a:00.0/class")
            );
            assert_eq!(text, "GPU");
        }
        other => panic!("expected BadInt, got {other:?}"),
    }
    fs::write(&class, "0x030200\n").expect("write");
    let local = class.with_file_name("local_cpulist");
    fs::write(&local, "3-1\n").expect("write");
    assert!(matches!(
        SysfsReader::new(dir.path()).read(None),
        Err(DiscoveryError::Cpulist { .. })
    ));
    fs::write(&local, "0-21\n").expect("write");
    // A device entry that is not a link into the PCI tree.
    let entry = dir.path().join("sys/bus/pci/devices/0000:1b:00.0");
    fs::remove_file(&entry).expect("rm");
    symlink("../../../devices/elsewhere", &entry).expect("link");
    match SysfsReader::new(dir.path()).read(None) {
        Err(DiscoveryError::Inconsistent { path, reason }) => {
            assert_eq!(path, entry);
            assert!(reason.contains("0000:1b:00.0"), "{reason}");
        }
        other => panic!("expected Inconsistent, got {other:?}"),
    }
}

#[test]
fn gpu_tree_feeds_the_engines_device_choice() {
    let m = SysfsReader::new(fixture_dir("x6-2-8gpu"))
        .read(None)
        .expect("read");
    let (index, keys) = agent::topology::devices::gpu_tree(&m.devices);
    assert_eq!(index.len(), 8);
    let addr = |chosen: Vec<usize>| -> Vec<String> {
        chosen
            .into_iter()
            .map(|c| m.devices[index[c]].address.clone())
            .collect()
    };
    // Two GPUs: a pair behind one switch.
    let two = sched::devices::choose_devices(2, &keys, |_| true).expect("2 of 8");
    assert_eq!(addr(two), ["0000:1a:00.0", "0000:1b:00.0"]);
    // With 1a busy, one GPU goes to its lone switch partner (best fit),
    // two go to the next whole switch, four to socket 1.
    let busy = |c: usize| m.devices[index[c]].address != "0000:1a:00.0";
    assert_eq!(
        addr(sched::devices::choose_devices(1, &keys, busy).expect("1")),
        ["0000:1b:00.0"]
    );
    assert_eq!(
        addr(sched::devices::choose_devices(2, &keys, busy).expect("2")),
        ["0000:3d:00.0", "0000:3e:00.0"]
    );
    assert_eq!(
        addr(sched::devices::choose_devices(4, &keys, busy).expect("4")),
        [
            "0000:88:00.0",
            "0000:89:00.0",
            "0000:b1:00.0",
            "0000:b2:00.0"
        ]
    );
}
