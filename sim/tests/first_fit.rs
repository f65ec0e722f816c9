//! The Slurm-like `first-fit` baseline through the simulator: EASY
//! backfill never delays the queue's head past its reservation while
//! short jobs fill the hole, gangs take the fewest racks (the "fewest
//! racks %" column) where least-loaded scatters them, and a gang replay
//! of the KTH excerpt runs whole.

mod common;

use sim::US_PER_S;
use sim::engine::{RunOutput, SimConfig, simulate};
use sim::layout::{Layout, cluster_for};
use sim::metrics;
use sim::policy::PolicySpec;
use sim::swf::{self, ReplayOptions};
use sim::workload::{Job, JobKind, Workload};

fn job(submit_s: u64, run_s: u64, limit_s: Option<u64>, cpus: u32, nodes: u32) -> Job {
    Job {
        submit_us: submit_s * US_PER_S,
        duration_us: run_s * US_PER_S,
        limit_us: limit_s.map(|l| l * US_PER_S),
        cpus,
        nodes,
        latency: false,
        after: None,
        group: 0,
        kind: JobKind::Single,
    }
}

fn workload(mut jobs: Vec<Job>) -> Workload {
    for (i, j) in jobs.iter_mut().enumerate() {
        j.group = i as u32;
    }
    Workload::new("t", jobs).unwrap()
}

fn run(layout: &Layout, w: &Workload, policy: &str) -> RunOutput {
    let cfg = SimConfig {
        sample_us: US_PER_S,
        ..SimConfig::default()
    };
    simulate(
        layout,
        w,
        &PolicySpec::parse(policy).unwrap(),
        &cfg,
        &mut |_| {},
    )
    .unwrap()
}

/// Four 1-CPU nodes. Job 0 runs 0..60 s (limit 100 s) on one node; the
/// head, a gang of 4, arrives at 1 s and is reserved the whole cluster at
/// 100 s; job 2 (limit 500 s) would hold a node past that and waits; job 3
/// (limit 50 s) fits the hole and runs at once. Job 0 ends early (60 s):
/// the gang starts then, before job 2, which runs after it.
#[test]
fn easy_backfill_fills_the_hole_without_delaying_the_head() {
    let layout = Layout::new("1z:1r:4n", "1s:1c:1t").unwrap();
    let w = workload(vec![
        job(0, 60, Some(100), 1, 1),
        job(1, 10, Some(10), 1, 4),
        job(1, 30, Some(500), 1, 1),
        job(1, 40, Some(50), 1, 1),
    ]);
    let out = run(&layout, &w, "first-fit");
    assert_eq!(out.unfinished, 0);
    let start = |i: usize| out.records[i].start / US_PER_S;
    assert_eq!(start(3), 1, "the short job backfills");
    assert_eq!(start(1), 60, "the head starts when job 0 ends");
    assert_eq!(start(2), 70, "the long job waits for the head");
}

/// Two racks of two 2-CPU nodes; a 1-CPU job holds node 0; a gang of two
/// 1-CPU members fits in one rack. First-fit puts it in rack 0 (best fit,
/// nodes 0 and 1); least-loaded takes the two most free nodes, 1 and 2,
/// across both racks.
#[test]
fn gangs_take_the_fewest_racks_where_least_loaded_scatters_them() {
    let layout = Layout::new("1z:2r:2n", "1s:2c:1t").unwrap();
    let w = workload(vec![
        job(0, 100, Some(100), 1, 1),
        job(1, 10, Some(10), 1, 2),
    ]);
    let mut pct = Vec::new();
    for policy in ["first-fit", "least-loaded"] {
        let out = run(&layout, &w, policy);
        let mut m = out.gang_members[0].1.clone();
        m.sort_unstable();
        let r = metrics::report(out, &w, &layout, 0);
        pct.push((m, r.large_gang_compact_pct, r.large_gangs));
    }
    assert_eq!(pct[0], (vec![0, 1], 100.0, 1));
    assert_eq!(pct[1], (vec![1, 2], 0.0, 1));
}

/// Two racks of two 2-CPU nodes; two 1-CPU jobs, which ours spreads over
/// both racks; then a gang of two 1-CPU members. Within any, ours still
/// puts it in one rack (the fewest racks that hold it, as topology/tree
/// does: `sched::gang`); asked for a rack (`ours+rack`, required, or
/// `ours+rackpref`, preferred), in one as well.
#[test]
fn ours_plus_rack_keeps_a_gang_that_fits_a_rack_in_one() {
    let layout = Layout::new("1z:2r:2n", "1s:2c:1t").unwrap();
    let w = workload(vec![
        job(0, 100, Some(100), 1, 1),
        job(0, 100, Some(100), 1, 1),
        job(1, 10, Some(10), 1, 2),
    ]);
    for (policy, racks) in [("ours", 1), ("ours+rack", 1), ("ours+rackpref", 1)] {
        let out = run(&layout, &w, policy);
        let m = out.gang_members[0].1.clone();
        let mut r: Vec<u32> = m.iter().map(|&n| layout.rack_of(n)).collect();
        r.dedup();
        assert_eq!(r.len(), racks, "{policy}: {m:?}");
        let rep = metrics::report(out, &w, &layout, 0);
        assert_eq!(
            rep.large_gang_compact_pct,
            if racks == 1 { 100.0 } else { 0.0 }
        );
    }
}

/// The KTH excerpt as gangs: every job finishes under first-fit, each
/// gang on as many distinct nodes as it asked for.
#[test]
fn the_kth_excerpt_runs_whole_as_gangs() {
    let t = swf::read(&common::data("KTH-SP2-1996-2.1-cln.excerpt.swf")).unwrap();
    let layout = Layout::new(&cluster_for(t.machine_procs(), 4), "1s:2c:2t").unwrap();
    let (w, stats) = t
        .to_workload(&ReplayOptions {
            node_cpus: 4,
            gangs: true,
            ..ReplayOptions::default()
        })
        .unwrap();
    assert!(stats.gangs > 50, "{stats:?}");
    let out = run(&layout, &w, "first-fit");
    assert_eq!(out.unfinished, 0);
    assert_eq!(out.gang_members.len(), stats.gangs);
    for (job, m) in &out.gang_members {
        let mut d = m.clone();
        d.sort_unstable();
        d.dedup();
        assert_eq!(d.len(), w.jobs[*job as usize].nodes as usize, "gang {job}");
    }
}
