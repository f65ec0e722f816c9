//! Fuzz the agent's sysfs topology discovery: the pure parsers of each
//! file's text (CPU lists such as `0-3,8,10-11` in `online`, `cpulist`,
//! `core_cpus_list` and a cache's `shared_cpu_list`; integers such as
//! `core_id`, `physical_package_id`, a cache's `level` and `id`; a cache's
//! `type`; PCI `class`/`vendor` hex), then a whole synthetic sysfs tree of
//! bounded size built from the input, CPUs, NUMA nodes and PCI devices with
//! their `/sys/bus/pci/devices` links, read with `SysfsReader`.
//! Nothing may panic; a tree that reads turns into an engine topology or a
//! typed error.
//!
//! The tree is held in memory (`SysfsTree`, read through
//! `SysfsReader::in_memory`), so the fuzzer spends its time in the parsing
//! rather than in writing files: about 850 inputs per second when each
//! tree was written to a temporary directory. `agent/tests/sysfs_memory.rs`
//! checks that the memory tree reads exactly like the same files on disk.
#![no_main]

use std::fmt::Write as _;

use agent::topology::devices::{parse_nvidia_minor, parse_sysfs_hex};
use agent::topology::{
    SysfsReader, SysfsTree, format_cpulist, parse_cache_type, parse_cpulist, parse_sysfs_int,
};
use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;

/// The text of one sysfs file: mostly well-formed values (so the reader
/// gets past its first file), sometimes anything.
#[derive(Arbitrary, Debug)]
enum Text {
    Num(u8),
    Neg(i16),
    List(Vec<(u8, u8)>),
    Raw(String),
}

impl Text {
    fn render(&self) -> String {
        match self {
            Text::Num(n) => format!("{n}\n"),
            Text::Neg(n) => format!("{n}\n"),
            Text::List(items) => {
                let mut s = String::new();
                for (i, (lo, len)) in items.iter().take(8).enumerate() {
                    if i > 0 {
                        s.push(',');
                    }
                    let lo = u32::from(*lo % 32);
                    match len % 4 {
                        0 => write!(s, "{lo}").unwrap(),
                        n => write!(s, "{lo}-{}", lo + u32::from(n)).unwrap(),
                    }
                }
                s.push('\n');
                s
            }
            Text::Raw(s) => s.chars().take(64).collect(),
        }
    }
}

#[derive(Arbitrary, Debug)]
struct Cache {
    level: Text,
    kind: Option<Text>,
    unified: bool,
    id: Option<Text>,
    shared: Text,
}

#[derive(Arbitrary, Debug)]
struct Cpu {
    core_id: Text,
    package: Text,
    die: Option<Text>,
    cluster: Option<Text>,
    siblings: Option<Text>,
    old_siblings: Option<Text>,
    caches: Vec<Cache>,
}

/// Where a device's `/sys/bus/pci/devices` link points.
#[derive(Arbitrary, Debug)]
enum Target {
    /// Under the host bridge through `bridges` switch ports (at most 3).
    Bridges(u8),
    /// Anything.
    Raw(String),
}

#[derive(Arbitrary, Debug)]
struct Device {
    bus: u8,
    target: Target,
    class: Text,
    vendor: Text,
    device: Text,
    numa: Option<Text>,
    local: Option<Text>,
    physfn: bool,
    drm: Vec<u8>,
    nvidia: Option<Text>,
}

#[derive(Arbitrary, Debug)]
struct Tree {
    raw: String,
    online: Text,
    cpus: Vec<Cpu>,
    nodes: Option<Vec<Text>>,
    devices: Vec<Device>,
    status: Option<Text>,
}

/// Hex values as PCI attributes hold them ("0x030200"), from a number.
fn hex(text: &Text) -> String {
    match text {
        Text::Num(n) => format!("0x{:06x}\n", (u32::from(*n) << 16) | 0x0200),
        Text::Neg(n) => format!("0x{:04x}\n", *n as u16),
        other => other.render(),
    }
}

fuzz_target!(|tree: Tree| {
    // The pure parsers on the raw text: never a panic, and a parsed list
    // prints and parses back to itself.
    if let Ok(cpus) = parse_cpulist(&tree.raw) {
        assert_eq!(parse_cpulist(&format_cpulist(&cpus)), Ok(cpus.clone()));
        assert!(cpus.windows(2).all(|w| w[0] < w[1]));
    }
    let _ = (parse_sysfs_int(&tree.raw), parse_cache_type(&tree.raw));
    let _ = (parse_sysfs_hex(&tree.raw), parse_nvidia_minor(&tree.raw));

    // A synthetic tree: at most 12 CPUs with 4 caches each, 4 nodes and 4
    // PCI devices.
    let mut t = SysfsTree::new();
    let sys = "sys/devices/system";
    t.file(format!("{sys}/cpu/online"), tree.online.render());
    for (i, cpu) in tree.cpus.iter().take(12).enumerate() {
        let dir = format!("{sys}/cpu/cpu{i}");
        let topo = format!("{dir}/topology");
        t.file(format!("{topo}/core_id"), cpu.core_id.render());
        t.file(format!("{topo}/physical_package_id"), cpu.package.render());
        if let Some(x) = &cpu.die {
            t.file(format!("{topo}/die_id"), x.render());
        }
        if let Some(x) = &cpu.cluster {
            t.file(format!("{topo}/cluster_id"), x.render());
        }
        if let Some(x) = &cpu.siblings {
            t.file(format!("{topo}/core_cpus_list"), x.render());
        }
        if let Some(x) = &cpu.old_siblings {
            t.file(format!("{topo}/thread_siblings_list"), x.render());
        }
        for (k, cache) in cpu.caches.iter().take(4).enumerate() {
            let c = format!("{dir}/cache/index{k}");
            t.file(format!("{c}/level"), cache.level.render());
            let kind = match &cache.kind {
                Some(x) => x.render(),
                None if cache.unified => "Unified\n".to_string(),
                None => "Data\n".to_string(),
            };
            t.file(format!("{c}/type"), kind);
            if let Some(x) = &cache.id {
                t.file(format!("{c}/id"), x.render());
            }
            t.file(format!("{c}/shared_cpu_list"), cache.shared.render());
        }
    }
    if let Some(nodes) = &tree.nodes {
        t.dir(format!("{sys}/node"));
        for (n, list) in nodes.iter().take(4).enumerate() {
            t.file(format!("{sys}/node/node{n}/cpulist"), list.render());
        }
    }
    for d in tree.devices.iter().take(4) {
        // Devices hang under switch ports of host bridge pci0000:00 (one
        // per bus, so equal buses share a switch).
        let address = format!("0000:{:02x}:00.0", d.bus);
        let (dir, target) = match &d.target {
            Target::Bridges(n) => {
                let mut dir = "sys/devices/pci0000:00".to_string();
                for b in 0..n % 4 {
                    write!(dir, "/0000:{:02x}:{:02x}.0", b, d.bus % 32).unwrap();
                }
                write!(dir, "/{address}").unwrap();
                let target = format!("../../../{}", dir.trim_start_matches("sys/"));
                (dir, target)
            }
            Target::Raw(s) => {
                let target: String = s.chars().take(128).collect();
                (format!("sys/devices/pci0000:00/{address}"), target)
            }
        };
        t.link(format!("sys/bus/pci/devices/{address}"), target);
        t.file(format!("{dir}/class"), hex(&d.class));
        t.file(format!("{dir}/vendor"), hex(&d.vendor));
        t.file(format!("{dir}/device"), hex(&d.device));
        if let Some(x) = &d.numa {
            t.file(format!("{dir}/numa_node"), x.render());
        }
        if let Some(x) = &d.local {
            t.file(format!("{dir}/local_cpulist"), x.render());
        }
        if d.physfn {
            t.link(format!("{dir}/physfn"), ".");
        }
        for card in d.drm.iter().take(3) {
            t.dir(format!("{dir}/drm/card{card}"));
        }
        if let Some(x) = &d.nvidia {
            t.file(
                format!("proc/driver/nvidia/gpus/{address}/information"),
                format!("Model: x\nDevice Minor: {}", x.render()),
            );
        }
    }
    if let Some(x) = &tree.status {
        t.file(
            "proc/self/status",
            format!("Name:\tagent\nCpus_allowed_list:\t{}", x.render()),
        );
    }
    let reader = SysfsReader::in_memory("/fuzz", t);
    let allowed = reader.default_allowed().ok().flatten();
    if let Ok(machine) = reader.read(allowed.as_deref()) {
        assert!(machine.nr_cpus() >= 1);
        let _ = machine.summary();
        let _ = machine.tree();
        if let Ok(topo) = machine.to_sched() {
            assert_eq!(topo.nr_leaves(), machine.nr_cpus());
        }
        for d in &machine.devices {
            assert!(d.local_cpus.iter().all(|c| machine.cpu(*c).is_some()));
        }
    }
});
