//! Fuzz the agent's sysfs topology discovery: the pure parsers of each
//! file's text (CPU lists such as `0-3,8,10-11` in `online`, `cpulist`,
//! `core_cpus_list` and a cache's `shared_cpu_list`; integers such as
//! `core_id`, `physical_package_id`, a cache's `level` and `id`; a cache's
//! `type`), then a whole synthetic sysfs tree of bounded size written to a
//! temporary directory from the input and read with `SysfsReader`.
//! Nothing may panic; a tree that reads turns into an engine topology or a
//! typed error.
#![no_main]

use std::fmt::Write as _;
use std::path::Path;
use std::sync::OnceLock;

use agent::topology::{
    SysfsReader, format_cpulist, parse_cache_type, parse_cpulist, parse_sysfs_int,
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

#[derive(Arbitrary, Debug)]
struct Tree {
    raw: String,
    online: Text,
    cpus: Vec<Cpu>,
    nodes: Option<Vec<Text>>,
}

fn put(path: &Path, text: &str) {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).expect("writable temp dir");
    }
    std::fs::write(path, text).expect("writable temp dir");
}

fn scratch() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| tempfile::tempdir().expect("a temp dir"))
        .path()
}

fuzz_target!(|tree: Tree| {
    // The pure parsers on the raw text: never a panic, and a parsed list
    // prints and parses back to itself.
    if let Ok(cpus) = parse_cpulist(&tree.raw) {
        assert_eq!(parse_cpulist(&format_cpulist(&cpus)), Ok(cpus.clone()));
        assert!(cpus.windows(2).all(|w| w[0] < w[1]));
    }
    let _ = (parse_sysfs_int(&tree.raw), parse_cache_type(&tree.raw));

    // A synthetic tree: at most 12 CPUs with 4 caches each and 4 nodes.
    let root = scratch().join("t");
    let _ = std::fs::remove_dir_all(&root);
    let sys = root.join("sys/devices/system");
    put(&sys.join("cpu/online"), &tree.online.render());
    for (i, cpu) in tree.cpus.iter().take(12).enumerate() {
        let dir = sys.join(format!("cpu/cpu{i}"));
        let topo = dir.join("topology");
        put(&topo.join("core_id"), &cpu.core_id.render());
        put(&topo.join("physical_package_id"), &cpu.package.render());
        if let Some(t) = &cpu.die {
            put(&topo.join("die_id"), &t.render());
        }
        if let Some(t) = &cpu.cluster {
            put(&topo.join("cluster_id"), &t.render());
        }
        if let Some(t) = &cpu.siblings {
            put(&topo.join("core_cpus_list"), &t.render());
        }
        if let Some(t) = &cpu.old_siblings {
            put(&topo.join("thread_siblings_list"), &t.render());
        }
        for (k, cache) in cpu.caches.iter().take(4).enumerate() {
            let c = dir.join(format!("cache/index{k}"));
            put(&c.join("level"), &cache.level.render());
            let kind = match &cache.kind {
                Some(t) => t.render(),
                None if cache.unified => "Unified\n".to_string(),
                None => "Data\n".to_string(),
            };
            put(&c.join("type"), &kind);
            if let Some(t) = &cache.id {
                put(&c.join("id"), &t.render());
            }
            put(&c.join("shared_cpu_list"), &cache.shared.render());
        }
    }
    if let Some(nodes) = &tree.nodes {
        std::fs::create_dir_all(sys.join("node")).expect("writable temp dir");
        for (n, list) in nodes.iter().take(4).enumerate() {
            put(&sys.join(format!("node/node{n}/cpulist")), &list.render());
        }
    }
    let reader = SysfsReader::new(&root);
    if let Ok(machine) = reader.read(None) {
        assert!(machine.nr_cpus() >= 1);
        let _ = machine.summary();
        let _ = machine.tree();
        if let Ok(topo) = machine.to_sched() {
            assert_eq!(topo.nr_leaves(), machine.nr_cpus());
        }
    }
});
