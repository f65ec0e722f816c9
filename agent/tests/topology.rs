//! Topology discovery against captured sysfs trees (tests/fixtures, written
//! by tests/fixtures/make_fixtures.py), the live machine, broken trees, and
//! the `agent topology` binary.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use agent::topology::{
    CacheKind, DiscoveryError, MachineTopology, SysfsReader, TopologySummary, format_cpulist,
    parse_cpulist, synthetic,
};
use sched::topology::DomainFlags;

fn fixture_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn read_fixture(name: &str) -> MachineTopology {
    SysfsReader::new(fixture_dir(name))
        .read(None)
        .unwrap_or_else(|e| panic!("fixture {name}: {e}"))
}

fn range(lo: u32, hi: u32) -> Vec<u32> {
    (lo..=hi).collect()
}

fn list(text: &str) -> Vec<u32> {
    parse_cpulist(text).unwrap_or_else(|e| panic!("{text}: {e}"))
}

/// Each grouping partitions the usable CPUs; cores nest in LLCs, LLCs in
/// packages; the engine accepts the tree; the tree view shows every CPU.
fn check_invariants(m: &MachineTopology) {
    let s = m.summary();
    let cpus = s.cpus.clone();
    assert!(cpus.windows(2).all(|w| w[0] < w[1]));
    for (name, groups) in [
        ("smt", &s.smt),
        ("llc", &s.llc),
        ("numa", &s.numa),
        ("package", &s.package),
    ] {
        let mut all: Vec<u32> = groups.iter().flatten().copied().collect();
        all.sort_unstable();
        assert_eq!(all, cpus, "{name} groups partition the CPUs");
        assert!(
            groups
                .iter()
                .all(|g| !g.is_empty() && g.windows(2).all(|w| w[0] < w[1]))
        );
        assert!(
            groups.windows(2).all(|w| w[0] < w[1]),
            "{name} groups sorted"
        );
    }
    let within = |inner: &[Vec<u32>], outer: &[Vec<u32>]| {
        inner
            .iter()
            .all(|g| outer.iter().any(|o| g.iter().all(|c| o.contains(c))))
    };
    assert!(within(&s.smt, &s.llc), "cores nest in LLCs");
    assert!(within(&s.llc, &s.package), "LLCs nest in packages");
    assert_eq!(s.llc_cache.len(), s.llc.len());
    assert_eq!(s.numa_ids.len(), s.numa.len());
    for c in &m.cpus {
        assert!(c.smt_siblings.contains(&c.cpu));
        assert!(c.llc_id < m.llcs.len());
    }
    let t = m.to_sched().expect("engine accepts the tree");
    assert_eq!(t.nr_leaves(), cpus.len());
    for (leaf, &cpu) in cpus.iter().enumerate() {
        assert_eq!(t.os_id(leaf), u64::from(cpu));
    }
    let tree = m.tree();
    let pus = tree
        .lines()
        .filter(|l| l.trim_start().starts_with("PU "))
        .count();
    assert_eq!(pus, cpus.len());
    let json = s.to_json().expect("json");
    let back: TopologySummary = serde_json::from_str(&json).expect("summary JSON parses back");
    assert_eq!(back, s);
}

#[test]
fn x6_2_fixture_groups() {
    let m = read_fixture("x6-2-88cpu");
    check_invariants(&m);
    let s = m.summary();
    assert_eq!(s.cpus, range(0, 87));
    assert_eq!(s.online, "0-87");
    assert_eq!(s.allowed, None);
    let smt: Vec<Vec<u32>> = (0..44).map(|c| vec![c, c + 44]).collect();
    assert_eq!(s.smt, smt);
    let socket0 = list("0-21,44-65");
    let socket1 = list("22-43,66-87");
    assert_eq!(s.llc, vec![socket0.clone(), socket1.clone()]);
    assert_eq!(s.llc_cache, vec!["L3", "L3"]);
    assert_eq!(s.numa, vec![socket0.clone(), socket1.clone()]);
    assert_eq!(s.numa_ids, vec![Some(0), Some(1)]);
    assert_eq!(s.package, vec![socket0, socket1]);

    // Per-CPU attributes: Broadwell's holey core ids, L3 id = socket.
    let c = m.cpu(50).expect("cpu 50");
    assert_eq!(
        (c.core_id, c.package_id, c.die_id, c.numa_node),
        (8, 0, Some(0), Some(0))
    );
    assert_eq!(c.smt_siblings, vec![6, 50]);
    let l3 = &m.llcs[m.cpu(87).expect("cpu 87").llc_id];
    assert_eq!(
        (l3.level, l3.kind, l3.kernel_id),
        (3, CacheKind::Unified, Some(1))
    );
    assert_eq!(l3.shared_cpus, list("22-43,66-87"));
}

#[test]
fn x6_2_fixture_builds_the_engine_tree() {
    let t = read_fixture("x6-2-88cpu").to_sched().expect("tree");
    assert_eq!(t.nr_leaves(), 88);
    assert_eq!(t.smt_siblings(0), &[0, 44]);
    assert_eq!(t.sd_llc_size(0), 44);
    assert!(t.share_llc(0, 65) && !t.share_llc(0, 22));
    assert_eq!(t.nr_numa(), 2);
    // LLC = NUMA node = package: one domain carrying all three flags.
    let llc = t.node(t.sd_llc(0));
    assert!(
        llc.flags()
            .contains(DomainFlags::LLC | DomainFlags::NUMA | DomainFlags::PACKAGE)
    );
    // The same machine as the engine's own spec for seed 000.
    let spec = sched::topology::Topology::from_spec("2s:22c:2t").expect("spec");
    for leaf in 0..88 {
        assert_eq!(t.smt_siblings(leaf), spec.smt_siblings(leaf));
        assert_eq!(t.llc_of(leaf), spec.llc_of(leaf));
        assert_eq!(t.numa_of(leaf), spec.numa_of(leaf));
    }
}

#[test]
fn synthetic_x6_2_matches_the_captured_tree() {
    let fixture = read_fixture("x6-2-88cpu").summary();
    let synth = synthetic("2s:22c:2t").expect("spec");
    check_invariants(&synth);
    let s = synth.summary();
    assert_eq!(
        (&s.cpus, &s.smt, &s.llc, &s.numa, &s.numa_ids, &s.package),
        (
            &fixture.cpus,
            &fixture.smt,
            &fixture.llc,
            &fixture.numa,
            &fixture.numa_ids,
            &fixture.package
        )
    );
}

/// Seed 002's NUMA layout: nodes 0,1,4,5, interleaved every 8 CPUs.
fn power10_node(k: u32, online: &[u32]) -> Vec<u32> {
    (0..320)
        .filter(|c| (c / 8) % 4 == k && online.contains(c))
        .collect()
}

#[test]
fn power10_fixture_groups() {
    let m = read_fixture("power10-smt8");
    check_invariants(&m);
    let s = m.summary();
    let online = range(0, 319);
    assert_eq!(s.cpus, online);
    let cores: Vec<Vec<u32>> = (0..40).map(|k| range(8 * k, 8 * k + 7)).collect();
    assert_eq!(s.smt, cores);
    // L2 per thread group is the LLC (no L3, no cache ids on powerpc).
    assert_eq!(s.llc, cores);
    assert!(s.llc_cache.iter().all(|c| c == "L2"));
    assert!(m.llcs.iter().all(|l| l.kernel_id.is_none() && l.level == 2));
    let nodes: Vec<Vec<u32>> = (0..4).map(|k| power10_node(k, &online)).collect();
    assert_eq!(s.numa, nodes);
    assert_eq!(s.numa_ids, vec![Some(0), Some(1), Some(4), Some(5)]);
    assert_eq!(
        format_cpulist(&s.numa[0]),
        "0-7,32-39,64-71,96-103,128-135,160-167,192-199,224-231,256-263,288-295"
    );
    assert_eq!(s.package, nodes);
    // die_id / cluster_id of -1 read as unknown.
    let c = m.cpu(9).expect("cpu 9");
    assert_eq!((c.die_id, c.cluster_id, c.numa_node), (None, None, Some(1)));

    let t = m.to_sched().expect("tree");
    assert_eq!(t.nr_numa(), 4);
    assert_eq!(t.sd_llc_size(9), 8);
    assert_eq!(t.smt_siblings(9), &[8, 9, 10, 11, 12, 13, 14, 15]);
    assert!(
        t.node(t.sd_llc(9))
            .flags()
            .contains(DomainFlags::SMT | DomainFlags::LLC)
    );
}

#[test]
fn power10_offline_cpus_are_skipped() {
    // CPUs 312-319 are offline: their topology/ and cache/ are gone.
    let m = read_fixture("power10-smt8-offline");
    check_invariants(&m);
    let s = m.summary();
    let online = range(0, 311);
    assert_eq!(s.online, "0-311");
    assert_eq!(s.cpus, online);
    assert_eq!(s.smt.len(), 39);
    assert_eq!(s.numa_ids, vec![Some(0), Some(1), Some(4), Some(5)]);
    assert_eq!(s.numa[3], power10_node(3, &online));
    // Node 5 lost its last thread group (312-319): 9 of 10 remain.
    assert_eq!(s.numa[3].len(), 72);
    assert_eq!(s.numa[3].last(), Some(&287));
    assert_eq!(s.numa[2].last(), Some(&311));
    assert!(m.cpu(312).is_none());
}

#[test]
fn arm_big_little_fixture_groups() {
    let m = read_fixture("arm-big-little");
    check_invariants(&m);
    let s = m.summary();
    assert_eq!(s.cpus, range(0, 5));
    let singletons: Vec<Vec<u32>> = (0..6).map(|c| vec![c]).collect();
    assert_eq!(
        s.smt, singletons,
        "no SMT, although core ids repeat across clusters"
    );
    assert_eq!(s.llc, vec![vec![0, 3, 4, 5], vec![1, 2]]);
    assert_eq!(s.llc_cache, vec!["L2", "L2"]);
    assert_eq!(s.numa, vec![range(0, 5)], "no node directory: one node");
    assert_eq!(s.numa_ids, vec![None]);
    assert_eq!(s.package, vec![range(0, 5)]);
    let c = m.cpu(2).expect("cpu 2");
    assert_eq!(
        (c.core_id, c.die_id, c.cluster_id, c.numa_node),
        (1, None, Some(1), None)
    );
    // The L2s have no ids: told apart by shared_cpu_list.
    assert_eq!(m.llcs[c.llc_id].shared_cpus, vec![1, 2]);

    let t = m.to_sched().expect("tree");
    assert_eq!(t.llcs()[t.llc_of(0)].members, vec![0, 3, 4, 5]);
    assert_eq!(t.llcs()[t.llc_of(1)].members, vec![1, 2]);
    assert_eq!(t.nr_numa(), 1);
}

/// Every file of `dir`, relative to it.
fn files_under(dir: &Path, rel: &Path, out: &mut Vec<PathBuf>) {
    let entries = fs::read_dir(dir.join(rel)).expect("read_dir");
    for entry in entries {
        let entry = entry.expect("entry");
        let rel = rel.join(entry.file_name());
        if entry.file_type().expect("file type").is_dir() {
            files_under(dir, &rel, out);
        } else {
            out.push(rel);
        }
    }
}

#[test]
fn live_machine_reads_and_agrees_with_its_capture() {
    let live = SysfsReader::host()
        .read(None)
        .expect("the live machine's /sys reads");
    check_invariants(&live);
    let captured = read_fixture("this-machine");
    check_invariants(&captured);

    // The capture is this machine when every captured file still holds what
    // the live one does; then both reads must agree exactly. On another
    // host (a CI runner) the live read is only checked for consistency.
    let dir = fixture_dir("this-machine");
    let mut files = Vec::new();
    files_under(&dir, Path::new(""), &mut files);
    assert!(files.len() > 10, "the capture has files");
    let same_machine = files
        .iter()
        .all(|rel| fs::read(dir.join(rel)).ok() == fs::read(Path::new("/").join(rel)).ok());
    if same_machine {
        let (mut l, c) = (live.summary(), captured.summary());
        l.source = c.source.clone();
        // The capture holds the CPU files only; devices are tested on the
        // x6-2-8gpu and x6-2-nogpu trees (tests/devices.rs).
        l.devices.clear();
        assert_eq!(l, c);
        assert_eq!(live.cpus, captured.cpus);
    } else {
        eprintln!("this host is not the captured machine: shape checks only");
    }
}

#[test]
fn allowed_filter_restricts_the_cpus() {
    let reader = SysfsReader::new(fixture_dir("x6-2-88cpu"));
    // Offline or absent CPUs in the filter (200) are ignored.
    let allowed = list("0-3,44-47,200");
    let m = reader.read(Some(&allowed)).expect("read");
    check_invariants(&m);
    let s = m.summary();
    assert_eq!(s.cpus, list("0-3,44-47"));
    assert_eq!(s.online, "0-87");
    assert_eq!(s.allowed.as_deref(), Some("0-3,44-47,200"));
    assert_eq!(
        s.smt,
        vec![vec![0, 44], vec![1, 45], vec![2, 46], vec![3, 47]]
    );
    assert_eq!(s.llc, vec![list("0-3,44-47")]);
    assert_eq!(s.package.len(), 1);

    // Half a core: its sibling list shrinks to what may be used.
    let m = reader.read(Some(&[0, 1, 45])).expect("read");
    assert_eq!(m.summary().smt, vec![vec![0], vec![1, 45]]);
    assert_eq!(m.cpu(0).expect("cpu 0").smt_siblings, vec![0]);

    let err = reader.read(Some(&[100, 101])).expect_err("nothing usable");
    assert!(matches!(err, DiscoveryError::NoCpus { .. }), "{err}");
    assert!(err.to_string().contains("0-87") && err.to_string().contains("100-101"));
}

/// Copy a fixture into a temporary directory to break it.
fn scratch_copy(name: &str) -> tempfile::TempDir {
    fn copy(from: &Path, to: &Path) {
        fs::create_dir_all(to).expect("mkdir");
        for entry in fs::read_dir(from).expect("read_dir") {
            let entry = entry.expect("entry");
            let (src, dst) = (entry.path(), to.join(entry.file_name()));
            if entry.file_type().expect("type").is_dir() {
                copy(&src, &dst);
            } else {
                fs::copy(&src, &dst).expect("copy");
            }
        }
    }
    let tmp = tempfile::tempdir().expect("tempdir");
    copy(&fixture_dir(name), tmp.path());
    tmp
}

fn sysfs(root: &Path, rel: &str) -> PathBuf {
    root.join("sys/devices/system").join(rel)
}

#[test]
fn process_affinity_is_read_through_the_root() {
    let tmp = scratch_copy("arm-big-little");
    let reader = SysfsReader::new(tmp.path());
    assert_eq!(reader.default_allowed().expect("no status file"), None);
    let status = tmp.path().join("proc/self/status");
    fs::create_dir_all(status.parent().expect("parent")).expect("mkdir");
    fs::write(
        &status,
        "Name:\tagent\nCpus_allowed:\t39\nCpus_allowed_list:\t0,3-5\n",
    )
    .expect("write");
    assert_eq!(
        reader.process_affinity().expect("affinity"),
        vec![0, 3, 4, 5]
    );
    let allowed = reader.default_allowed().expect("affinity");
    let m = reader.read(allowed.as_deref()).expect("read");
    assert_eq!(m.summary().llc, vec![vec![0, 3, 4, 5]]);

    fs::write(&status, "Name:\tagent\nCpus_allowed_list:\t0-x\n").expect("write");
    let err = reader.process_affinity().expect_err("garbage");
    assert!(
        err.to_string().contains(&status.display().to_string()),
        "{err}"
    );
    fs::write(&status, "Name:\tagent\n").expect("write");
    let err = reader.process_affinity().expect_err("no line");
    assert!(err.to_string().contains("Cpus_allowed_list"), "{err}");

    // The live process has an affinity, and it names online CPUs.
    let host = SysfsReader::host();
    let affinity = host.process_affinity().expect("live affinity");
    let m = host.read(Some(&affinity)).expect("live read");
    assert!(m.cpus.iter().all(|c| affinity.contains(&c.cpu)));
}

/// Read a broken tree; the error must name `file`.
fn expect_error_naming(root: &Path, file: &Path) -> DiscoveryError {
    let err = SysfsReader::new(root).read(None).expect_err("broken tree");
    let msg = err.to_string();
    assert!(
        msg.contains(&file.display().to_string()),
        "error {msg:?} does not name {}",
        file.display()
    );
    err
}

#[test]
fn missing_online_file_is_named() {
    let tmp = scratch_copy("arm-big-little");
    let online = sysfs(tmp.path(), "cpu/online");
    fs::remove_file(&online).expect("rm");
    let err = expect_error_naming(tmp.path(), &online);
    assert!(matches!(err, DiscoveryError::Missing { .. }));
    // A root with no sysfs at all says the same.
    let empty = tempfile::tempdir().expect("tempdir");
    expect_error_naming(empty.path(), &sysfs(empty.path(), "cpu/online"));
}

#[test]
fn garbage_cpulists_are_named() {
    let tmp = scratch_copy("x6-2-88cpu");
    let online = sysfs(tmp.path(), "cpu/online");
    fs::write(&online, "0-3,banana\n").expect("write");
    let err = expect_error_naming(tmp.path(), &online);
    assert!(matches!(err, DiscoveryError::Cpulist { .. }));
    assert!(err.to_string().contains("banana"));

    fs::write(&online, "0-87\n").expect("write");
    let node = sysfs(tmp.path(), "node/node1/cpulist");
    fs::write(&node, "22-43,66-\n").expect("write");
    expect_error_naming(tmp.path(), &node);

    fs::write(&node, "22-43,66-87\n").expect("write");
    let siblings = sysfs(tmp.path(), "cpu/cpu5/topology/core_cpus_list");
    fs::write(&siblings, "5,49-48\n").expect("write");
    expect_error_naming(tmp.path(), &siblings);

    fs::write(&siblings, "5,49\n").expect("write");
    let shared = sysfs(tmp.path(), "cpu/cpu7/cache/index3/shared_cpu_list");
    fs::write(&shared, "0-21,,44-65\n").expect("write");
    expect_error_naming(tmp.path(), &shared);
}

#[test]
fn missing_or_malformed_cpu_files_are_named() {
    let tmp = scratch_copy("arm-big-little");
    let root = tmp.path();

    let core_id = sysfs(root, "cpu/cpu3/topology/core_id");
    fs::remove_file(&core_id).expect("rm");
    expect_error_naming(root, &core_id);
    fs::write(&core_id, "three\n").expect("write");
    assert!(matches!(
        expect_error_naming(root, &core_id),
        DiscoveryError::BadInt { .. }
    ));
    fs::write(&core_id, "1\n").expect("write");

    let level = sysfs(root, "cpu/cpu4/cache/index2/level");
    fs::write(&level, "\n").expect("write");
    expect_error_naming(root, &level);
    fs::write(&level, "300\n").expect("write");
    expect_error_naming(root, &level);
    fs::write(&level, "2\n").expect("write");

    // No sibling list under either name.
    let siblings = sysfs(root, "cpu/cpu1/topology/thread_siblings_list");
    fs::remove_file(&siblings).expect("rm");
    expect_error_naming(root, &siblings);
    // A CPU missing from its own sibling list.
    fs::write(&siblings, "2\n").expect("write");
    assert!(matches!(
        expect_error_naming(root, &siblings),
        DiscoveryError::Inconsistent { .. }
    ));
    // Siblings that disagree: CPU 1 claims CPU 2, CPU 2 claims only itself.
    fs::write(&siblings, "1-2\n").expect("write");
    let other = sysfs(root, "cpu/cpu2/topology/thread_siblings_list");
    expect_error_naming(root, &other);
    fs::write(&siblings, "1\n").expect("write");

    // A CPU in two NUMA nodes.
    fs::create_dir_all(sysfs(root, "node/node0")).expect("mkdir");
    fs::create_dir_all(sysfs(root, "node/node2")).expect("mkdir");
    fs::write(sysfs(root, "node/node0/cpulist"), "0-3\n").expect("write");
    let node2 = sysfs(root, "node/node2/cpulist");
    fs::write(&node2, "3-5\n").expect("write");
    expect_error_naming(root, &node2);
    // A node directory without its cpulist.
    fs::remove_file(&node2).expect("rm");
    expect_error_naming(root, &node2);
    // Repaired: sparse node ids and an empty (CPU-less) node read fine.
    fs::write(&node2, "4-5\n").expect("write");
    fs::create_dir_all(sysfs(root, "node/node7")).expect("mkdir");
    fs::write(sysfs(root, "node/node7/cpulist"), "\n").expect("write");
    let s = SysfsReader::new(root)
        .read(None)
        .expect("repaired")
        .summary();
    assert_eq!(s.numa, vec![range(0, 3), vec![4, 5]]);
    assert_eq!(s.numa_ids, vec![Some(0), Some(2)]);
}

#[test]
fn optional_files_fall_back() {
    let tmp = scratch_copy("x6-2-88cpu");
    let root = tmp.path();
    // No cluster_id / die_id (older kernels), no cache directory at all,
    // no node directory: the package stands in for LLC, one NUMA node.
    for cpu in 0..88 {
        let dir = sysfs(root, &format!("cpu/cpu{cpu}"));
        fs::remove_file(dir.join("topology/cluster_id")).expect("rm");
        fs::remove_file(dir.join("topology/die_id")).expect("rm");
        fs::remove_file(dir.join("topology/core_cpus_list")).expect("rm");
        fs::remove_dir_all(dir.join("cache")).expect("rm");
    }
    fs::remove_dir_all(sysfs(root, "node")).expect("rm");
    let m = SysfsReader::new(root).read(None).expect("read");
    check_invariants(&m);
    let s = m.summary();
    assert_eq!(s.smt.len(), 44, "thread_siblings_list is used");
    assert_eq!(s.llc, s.package);
    assert_eq!(s.llc_cache, vec!["LLC?", "LLC?"]);
    assert_eq!(s.numa, vec![range(0, 87)]);
    let c = m.cpu(0).expect("cpu 0");
    assert_eq!((c.die_id, c.cluster_id, c.numa_node), (None, None, None));
    // Unknown ids (-1) for core and package.
    fs::write(sysfs(root, "cpu/cpu3/topology/core_id"), "-1\n").expect("write");
    fs::write(sysfs(root, "cpu/cpu3/topology/physical_package_id"), "-1\n").expect("write");
    let m = SysfsReader::new(root).read(Some(&[3])).expect("read");
    let c = m.cpu(3).expect("cpu 3");
    assert_eq!((c.core_id, c.package_id), (3, 0));
}

#[test]
fn this_machine_capture_reads() {
    // The machine this agent was first developed on: 2 CPUs, no SMT, one
    // L3, one NUMA node, and x86's "no cluster" id 65535 in cluster_id.
    let m = read_fixture("this-machine");
    check_invariants(&m);
    let s = m.summary();
    assert_eq!(s.cpus, vec![0, 1]);
    assert_eq!(s.smt, vec![vec![0], vec![1]]);
    assert_eq!(s.llc, vec![vec![0, 1]]);
    assert_eq!(s.llc_cache, vec!["L3"]);
    assert_eq!(s.numa_ids, vec![Some(0)]);
    let c = m.cpu(1).expect("cpu 1");
    assert_eq!((c.core_id, c.die_id, c.cluster_id), (1, Some(0), None));
}

fn agent(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_agent"))
        .args(args)
        .output()
        .expect("run agent")
}

#[test]
fn binary_prints_json_for_the_x6_2_fixture() {
    let root = fixture_dir("x6-2-88cpu");
    let root = root.to_str().expect("utf-8 path");
    let out = agent(&["topology", "--sysfs-root", root, "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).expect("valid JSON");
    let cpus = json["cpus"].as_array().expect("cpus");
    assert_eq!(cpus.len(), 88);
    assert_eq!(json["smt"].as_array().expect("smt").len(), 44);
    assert_eq!(json["llc"].as_array().expect("llc").len(), 2);
    assert_eq!(json["numa"].as_array().expect("numa").len(), 2);
    assert_eq!(json["package"].as_array().expect("package").len(), 2);
    assert_eq!(json["smt"][0], serde_json::json!([0, 44]));
    let summary: TopologySummary = serde_json::from_slice(&out.stdout).expect("summary");
    assert_eq!(summary, read_fixture("x6-2-88cpu").summary());

    // The synthetic spec of the same machine prints the same groups.
    let out = agent(&["topology", "--topology", "2s:22c:2t", "--json"]);
    assert!(out.status.success());
    let synth: TopologySummary = serde_json::from_slice(&out.stdout).expect("summary");
    assert_eq!(
        (synth.smt, synth.llc, synth.numa),
        (summary.smt, summary.llc, summary.numa)
    );
}

#[test]
fn binary_prints_a_tree_and_clear_errors() {
    let root = fixture_dir("x6-2-88cpu");
    let root = root.to_str().expect("utf-8 path");
    let out = agent(&["topology", "--sysfs-root", root]);
    assert!(out.status.success());
    let tree = String::from_utf8(out.stdout).expect("utf-8");
    let lines: Vec<&str> = tree.lines().collect();
    assert!(
        lines[0].starts_with("Machine (88 CPUs: 0-87; 2 packages, 2 NUMA nodes, 2 LLCs, 44 cores)")
    );
    assert_eq!(lines[1], "  Package L#0 (P#0) cpus 0-21,44-65");
    assert_eq!(lines[2], "    NUMANode L#0 (P#0) cpus 0-21,44-65");
    assert_eq!(lines[3], "      L3 L#0 id 0 cpus 0-21,44-65");
    assert_eq!(lines[4], "        Core L#0 (P#0) cpus 0,44");
    assert_eq!(lines[5], "          PU L#0 (P#0)");
    assert_eq!(lines[6], "          PU L#1 (P#44)");
    assert_eq!(tree.lines().filter(|l| l.contains("PU L#")).count(), 88);

    let out = agent(&["topology", "--sysfs-root", root, "--cpus", "22-23"]);
    assert!(out.status.success());
    let tree = String::from_utf8(out.stdout).expect("utf-8");
    assert!(
        tree.starts_with("Machine (2 of 88 online CPUs: 22-23;"),
        "{tree}"
    );

    // The live machine, as the agent sees itself.
    let out = agent(&["topology", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let live: TopologySummary = serde_json::from_slice(&out.stdout).expect("summary");
    assert!(
        live.allowed.is_some(),
        "the live read applies the process's affinity"
    );

    let missing = std::env::temp_dir().join("agent-no-such-root");
    let out = agent(&["topology", "--sysfs-root", missing.to_str().expect("utf-8")]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("sys/devices/system/cpu/online"), "{err}");

    for bad in [
        &["topology", "--topology", "2z:4r:8n"][..],
        &["topology", "--topology", "banana"],
        &["topology", "--sysfs-root", root, "--cpus", "1-x"],
        &["topology", "--sysfs-root", root, "--topology", "1s:2c"],
    ] {
        let out = agent(bad);
        assert!(!out.status.success(), "{bad:?} should fail");
        assert!(!out.stderr.is_empty());
    }
}
