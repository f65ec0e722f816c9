//! `dispatch-sim swf --gangs` on the archive's real KTH SP2 trace: every
//! record larger than a node is one gang, least-loaded and the dispatcher
//! ("ours") run all of them to the end, each gang's members together on
//! distinct nodes, and the report carries the gang and fragmentation
//! columns.

mod common;

use std::process::Command;

use sim::US_PER_S;
use sim::engine::{SimConfig, simulate};
use sim::layout::{Layout, cluster_for};
use sim::policy::PolicySpec;
use sim::swf::{self, ReplayOptions};

const KTH: &str = "KTH-SP2-1996-2.1-cln.swf.gz";

fn kth_path() -> Option<std::path::PathBuf> {
    let p = common::shared_trace(KTH);
    if p.is_none() {
        // CI lays the archive's traces in ../shared/traces: there a
        // missing trace is a failure, never a silent skip.
        assert!(
            std::env::var_os("CI").is_none(),
            "{KTH}: not in ../shared/traces beside the repository, which CI provides"
        );
        eprintln!("{KTH}: not in ../shared/traces; skipped outside CI");
    }
    p
}

/// The first 1500 records as gangs, through the library: every gang
/// finishes, with as many distinct member nodes as it asked for, starting
/// and ending together (one record per gang).
#[test]
fn kth_gangs_run_whole_under_least_loaded_and_ours() {
    let Some(path) = kth_path() else { return };
    let t = swf::read(&path).unwrap();
    let layout = Layout::new(&cluster_for(t.machine_procs(), 4), "1s:2c:2t").unwrap();
    let (w, stats) = t
        .to_workload(&ReplayOptions {
            node_cpus: 4,
            limit: Some(1500),
            gangs: true,
            ..ReplayOptions::default()
        })
        .unwrap();
    assert_eq!(stats.split, 0);
    assert!(stats.gangs > 50, "{stats:?}");
    let gangs = w.jobs.iter().filter(|j| j.nodes > 1).count();
    assert_eq!(gangs, stats.gangs);
    for policy in ["least-loaded", "ours"] {
        let cfg = SimConfig {
            tick_us: 60 * US_PER_S,
            ..SimConfig::default()
        };
        let out = simulate(
            &layout,
            &w,
            &PolicySpec::parse(policy).unwrap(),
            &cfg,
            &mut |_| {},
        )
        .unwrap();
        assert_eq!(out.unfinished, 0, "{policy}");
        assert_eq!(out.gang_members.len(), gangs, "{policy}");
        for (job, members) in &out.gang_members {
            let j = &w.jobs[*job as usize];
            let mut m = members.clone();
            m.sort_unstable();
            m.dedup();
            assert_eq!(m.len(), j.nodes as usize, "{policy}: job {job}");
            let r = &out.records[*job as usize];
            assert_eq!(r.end, r.start + j.duration_us, "{policy}: job {job}");
        }
    }
}

/// The binary's flag: a CSV report whose gang columns count the gangs.
#[test]
fn swf_gangs_flag_reports_gangs() {
    let Some(path) = kth_path() else { return };
    let out = Command::new(env!("CARGO_BIN_EXE_dispatch-sim"))
        .args(["swf", "--trace"])
        .arg(&path)
        .args([
            "--gangs",
            "--limit",
            "1500",
            "--policies",
            "least-loaded,ours",
            "--tick-ms",
            "60000",
            "--format",
            "csv",
            "--no-progress",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let col = |name: &str| header.iter().position(|h| *h == name).unwrap();
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    assert_eq!(rows.len(), 2);
    for r in rows {
        assert_eq!(r[col("unfinished")], "0", "{r:?}");
        let gangs: u64 = r[col("gangs")].parse().unwrap();
        assert!(gangs > 50, "{r:?}");
        let free: f64 = r[col("racks_free_pct")].parse().unwrap();
        assert!((0.0..=100.0).contains(&free), "{r:?}");
    }
}
