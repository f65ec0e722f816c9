//! The two sources of a `SysfsReader` cannot drift: every captured fixture
//! of tests/fixtures, loaded into a `SysfsTree`, reads to the same topology
//! as from disk; and random trees, good and broken (missing files,
//! directories where files belong, garbage, bad UTF-8, dangling and
//! looping links), written both to disk and into memory, read to the same
//! topology or the very same error message.

use std::fs;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};

use agent::topology::{MachineTopology, SysfsReader, SysfsTree};
use proptest::prelude::*;

fn fixtures() -> Vec<(String, PathBuf)> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let mut out: Vec<(String, PathBuf)> = fs::read_dir(&dir)
        .expect("tests/fixtures")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.is_dir())
        .map(|p| (p.file_name().unwrap().to_string_lossy().into_owned(), p))
        .collect();
    out.sort();
    out
}

/// The result with the source line (which says disk or memory) blanked;
/// an error as its message, which names the file and the kernel's error.
fn normalized(r: agent::topology::Result<MachineTopology>) -> Result<MachineTopology, String> {
    r.map(|mut m| {
        m.source.clear();
        m
    })
    .map_err(|e| e.to_string())
}

#[test]
fn every_fixture_reads_the_same_from_memory_and_from_disk() {
    let fixtures = fixtures();
    assert!(fixtures.len() >= 7, "fixtures found: {fixtures:?}");
    for (name, dir) in fixtures {
        let disk = SysfsReader::new(&dir);
        let tree = SysfsTree::load(&dir).unwrap_or_else(|e| panic!("{name}: load: {e}"));
        let memory = SysfsReader::in_memory(&dir, tree);
        assert!(memory.is_in_memory() && !disk.is_in_memory());
        let from_disk = disk
            .read(None)
            .unwrap_or_else(|e| panic!("{name}: disk: {e}"));
        let from_memory = memory
            .read(None)
            .unwrap_or_else(|e| panic!("{name}: memory: {e}"));
        assert!(from_memory.source.starts_with("sysfs in memory"));
        assert_eq!(
            normalized(Ok(from_memory.clone())),
            normalized(Ok(from_disk.clone())),
            "{name}"
        );
        assert_eq!(from_memory.summary().to_json().ok(), {
            let mut s = from_disk.summary();
            s.source = from_memory.source.clone();
            s.to_json().ok()
        });
        assert_eq!(
            memory.default_allowed().map_err(|e| e.to_string()),
            disk.default_allowed().map_err(|e| e.to_string()),
            "{name}"
        );
        // Half the CPUs allowed: the filter reads the same way too.
        let half: Vec<u32> = from_disk.online.iter().copied().step_by(2).collect();
        assert_eq!(
            normalized(memory.read(Some(&half))),
            normalized(disk.read(Some(&half))),
            "{name} restricted to {half:?}"
        );
        if name.starts_with("x6-2-8gpu") {
            assert_eq!(from_memory.devices.len(), 10, "the devices were read");
        }
    }
}

/// One entry of a random tree.
#[derive(Clone, Debug)]
enum Node {
    File(Vec<u8>),
    Dir,
    Link(String),
}

/// File contents: well-formed values of every file, and garbage.
const TEXTS: &[&[u8]] = &[
    b"0\n",
    b"1\n",
    b"2\n",
    b"3\n",
    b"-1\n",
    b"65535\n",
    b"x\n",
    b"",
    b"0-3\n",
    b"3-1\n",
    b"0,2\n",
    b"1-2\n",
    b"0-1\n",
    b"Unified\n",
    b"Data\n",
    b"Instruction\n",
    b"0x030200\n",
    b"0x10de\n",
    b"0x020000\n",
    b"0x1a03\n",
    b"Device Minor: \t 3\n",
    b"\xff\xfe\n",
];

fn text() -> impl Strategy<Value = Vec<u8>> {
    prop::sample::select(TEXTS).prop_map(<[u8]>::to_vec)
}

/// A file that usually holds one of `good`, sometimes (one in twenty)
/// any text, a NUL byte, a directory, or nothing.
fn file(path: String, good: &[&str]) -> BoxedStrategy<Vec<(String, Node)>> {
    let good: Vec<Vec<u8>> = good.iter().map(|g| format!("{g}\n").into_bytes()).collect();
    prop_oneof![
        95 => prop::sample::select(good).prop_map(|t| Some(Node::File(t))),
        2 => text().prop_map(|t| Some(Node::File(t))),
        1 => Just(Some(Node::File(b"\x00".to_vec()))),
        1 => Just(Some(Node::Dir)),
        1 => Just(None),
    ]
    .prop_map(move |n| n.map(|n| (path.clone(), n)).into_iter().collect())
    .boxed()
}

/// A CPU's SMT siblings in `core_cpus_list`, the older
/// `thread_siblings_list`, or both.
fn siblings(topo: &str, pair: &str) -> BoxedStrategy<Vec<(String, Node)>> {
    let (new, old) = (
        file(format!("{topo}/core_cpus_list"), &[pair]),
        file(format!("{topo}/thread_siblings_list"), &[pair]),
    );
    prop_oneof![
        new.clone(),
        old.clone(),
        (new, old).prop_map(|(a, b)| a.into_iter().chain(b).collect()),
    ]
    .boxed()
}

/// A file the kernel may leave out: as [`file`], or absent.
fn optional(path: String, good: &[&str]) -> BoxedStrategy<Vec<(String, Node)>> {
    prop_oneof![Just(Vec::new()), file(path, good)].boxed()
}

fn cpu(i: usize) -> impl Strategy<Value = Vec<(String, Node)>> {
    let topo = format!("sys/devices/system/cpu/cpu{i}/topology");
    let me = i.to_string();
    let mut parts: Vec<BoxedStrategy<Vec<(String, Node)>>> = vec![
        file(format!("{topo}/core_id"), &["0", "1", &me]),
        file(format!("{topo}/physical_package_id"), &["0", "1", "-1"]),
        optional(format!("{topo}/die_id"), &["0", "-1"]),
        optional(format!("{topo}/cluster_id"), &["0", "1", "65535"]),
        siblings(&topo, if i < 2 { "0-1" } else { "2-3" }),
    ];
    for k in 0..2 {
        let c = format!("sys/devices/system/cpu/cpu{i}/cache/index{k}");
        parts.push(file(format!("{c}/level"), &["1", "2", "3"]));
        parts.push(file(
            format!("{c}/type"),
            &["Unified", "Data", "Instruction"],
        ));
        parts.push(optional(format!("{c}/id"), &["0", "1"]));
        parts.push(file(format!("{c}/shared_cpu_list"), &["0-3", &me]));
    }
    parts.prop_map(|v| v.into_iter().flatten().collect())
}

/// A PCI device under a switch port, its `/sys/bus/pci/devices` link
/// (right, not ending at the device, dangling or a loop), and maybe a
/// `physfn` link and DRM cards.
fn device(i: usize) -> impl Strategy<Value = Vec<(String, Node)>> {
    let addr = format!("0000:0{i}:00.0");
    let dir = format!("sys/devices/pci0000:00/0000:00:03.0/{addr}");
    let parts: Vec<BoxedStrategy<Vec<(String, Node)>>> = vec![
        file(
            format!("{dir}/class"),
            &["0x030200", "0x020000", "0x120000"],
        ),
        file(format!("{dir}/vendor"), &["0x10de", "0x15b3"]),
        file(format!("{dir}/device"), &["0x20b0"]),
        optional(format!("{dir}/numa_node"), &["0", "-1"]),
        optional(format!("{dir}/local_cpulist"), &["0-3", "0-1"]),
    ];
    let link = format!("sys/bus/pci/devices/{addr}");
    let right = format!("../../../devices/pci0000:00/0000:00:03.0/{addr}");
    let targets = vec![
        right.clone(),
        right.clone(),
        right.clone(),
        right.clone(),
        right,
        "../../../devices/pci0000:00/0000:00:03.0".to_string(),
        format!("../../../devices/pci0000:01/{addr}"),
        addr.clone(),
        format!("/sys/devices/pci0000:00/0000:00:03.0/{addr}"),
    ];
    let extra = (
        prop::sample::select(targets),
        prop::option::of(prop::sample::select(vec![".", "../gone"])),
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(move |(target, physfn, drm, nvidia)| {
            let mut v = vec![(link.clone(), Node::Link(target))];
            if let Some(physfn) = physfn {
                v.push((format!("{dir}/physfn"), Node::Link(physfn.into())));
            }
            if drm {
                v.push((format!("{dir}/drm/card1"), Node::Dir));
                v.push((format!("{dir}/drm/renderD128"), Node::Dir));
            }
            if nvidia {
                v.push((
                    format!("proc/driver/nvidia/gpus/{addr}/information"),
                    Node::File(b"Model: x\nDevice Minor: \t 3\n".to_vec()),
                ));
            }
            v
        });
    (parts, extra).prop_map(|(parts, extra)| parts.into_iter().flatten().chain(extra).collect())
}

fn tree() -> impl Strategy<Value = Vec<(String, Node)>> {
    let online = file(
        "sys/devices/system/cpu/online".to_string(),
        &["0", "0-1", "0-3", "1-2"],
    );
    let cpus: Vec<_> = (0..4).map(cpu).collect();
    let nodes = prop::option::of((
        file(
            "sys/devices/system/node/node0/cpulist".to_string(),
            &["0-1"],
        ),
        file(
            "sys/devices/system/node/node1/cpulist".to_string(),
            &["2-3"],
        ),
    ))
    .prop_map(|n| n.map(|(a, b)| a.into_iter().chain(b)));
    let devices: Vec<_> = (0..2).map(|i| prop::option::of(device(i))).collect();
    let status = prop_oneof![
        Just(Vec::new()),
        Just(vec![(
            "proc/self/status".to_string(),
            Node::File(b"Name:\tx\nCpus_allowed_list:\t0-2\n".to_vec())
        )]),
        Just(vec![(
            "proc/self/status".to_string(),
            Node::File(b"Name:\tx\n".to_vec())
        )]),
    ];
    (online, cpus, nodes, devices, status).prop_map(|(o, c, n, d, s)| {
        o.into_iter()
            .chain(c.into_iter().flatten())
            .chain(n.into_iter().flatten())
            .chain(d.into_iter().flatten().flatten())
            .chain(s)
            .collect()
    })
}

fn write_both(root: &Path, entries: &[(String, Node)]) -> SysfsTree {
    let mut tree = SysfsTree::new();
    for (path, node) in entries {
        let full = root.join(path);
        fs::create_dir_all(full.parent().expect("parent")).expect("mkdir");
        match node {
            Node::File(bytes) => {
                fs::write(&full, bytes).expect("write");
                tree.file(path, bytes.clone());
            }
            Node::Dir => {
                fs::create_dir_all(&full).expect("mkdir");
                tree.dir(path);
            }
            Node::Link(target) => {
                // An absolute target means from the tree's root in memory;
                // on disk it is made to point there.
                let on_disk = match target.strip_prefix('/') {
                    Some(rel) => root.join(rel),
                    None => PathBuf::from(target),
                };
                symlink(on_disk, &full).expect("symlink");
                tree.link(path, target.as_str());
            }
        }
    }
    tree
}

/// Random trees, each read from disk, from memory, and from the tree
/// captured back from disk; counts how many read to a topology, so the
/// comparison is not only of errors.
#[test]
fn random_trees_read_the_same_from_memory_and_from_disk() {
    use proptest::test_runner::{Config, TestRunner};
    const CASES: u32 = 128;
    let ok = std::cell::Cell::new(0u32);
    let with_devices = std::cell::Cell::new(0u32);
    let mut runner = TestRunner::new(Config {
        cases: CASES,
        ..Config::default()
    });
    runner
        .run(&tree(), |entries| {
            let dir = tempfile::tempdir().expect("tempdir");
            let root = dir.path();
            let tree = write_both(root, &entries);
            let (disk, memory) = (SysfsReader::new(root), SysfsReader::in_memory(root, tree));
            let from_disk = normalized(disk.read(None));
            if let Ok(m) = &from_disk {
                ok.set(ok.get() + 1);
                if !m.devices.is_empty() {
                    with_devices.set(with_devices.get() + 1);
                }
            }
            prop_assert_eq!(normalized(memory.read(None)), from_disk.clone());
            prop_assert_eq!(
                memory.default_allowed().map_err(|e| e.to_string()),
                disk.default_allowed().map_err(|e| e.to_string())
            );
            prop_assert_eq!(
                normalized(memory.read(Some(&[1, 2]))),
                normalized(disk.read(Some(&[1, 2])))
            );
            // The tree captured back from disk reads the same too.
            let loaded = SysfsTree::load(root).expect("load");
            let loaded = SysfsReader::in_memory(root, loaded);
            prop_assert_eq!(normalized(loaded.read(None)), from_disk);
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{e}"));
    // Both outcomes were compared, and devices were read in some.
    assert!(
        ok.get() >= CASES / 20 && ok.get() < CASES,
        "{} of {CASES} trees read to a topology",
        ok.get()
    );
    assert!(with_devices.get() > 0, "no tree read with a device");
}
