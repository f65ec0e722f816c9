//! Trace replays and synthetic runs through every policy: deterministic
//! for a seed, conservative (every job runs once, never on a node with
//! too few CPUs), and the dispatcher's mechanisms visible in the counters.

mod common;

use sim::engine::{RunOutput, SimConfig, simulate};
use sim::layout::{Layout, cluster_for};
use sim::policy::PolicySpec;
use sim::swf::{self, ReplayOptions};
use sim::workload::{SyntheticParams, Workload, synthetic};
use sim::{US_PER_S, metrics};

fn kth() -> (Layout, Workload) {
    let t = swf::read(&common::data("KTH-SP2-1996-2.1-cln.excerpt.swf")).unwrap();
    let layout = Layout::new(&cluster_for(t.machine_procs(), 4), "1s:2c:2t").unwrap();
    let (w, _) = t
        .to_workload(&ReplayOptions {
            node_cpus: 4,
            limit: Some(250),
            seed: 3,
            ..ReplayOptions::default()
        })
        .unwrap();
    (layout, w)
}

fn run(layout: &Layout, w: &Workload, policy: &str, seed: u64, cpu_level: bool) -> RunOutput {
    // A coarse dispatcher tick keeps the debug-build test fast over the
    // trace's days of simulated time; determinism does not depend on it.
    let cfg = SimConfig {
        seed,
        cpu_level,
        tick_us: 60 * US_PER_S,
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

fn check_conservation(layout: &Layout, w: &Workload, out: &RunOutput) {
    assert_eq!(out.unfinished, 0, "{}", out.policy);
    // Replay the records: no node ever runs more CPUs than it has.
    let mut ev: Vec<(u64, i64, u32)> = Vec::new();
    for (j, r) in w.jobs.iter().zip(&out.records) {
        assert!(
            r.submit <= r.assigned && r.assigned <= r.start,
            "{}",
            out.policy
        );
        assert_eq!(r.end, r.start + j.duration_us, "{}", out.policy);
        ev.push((r.start, j.cpus as i64, r.node));
        ev.push((r.end, -(j.cpus as i64), r.node));
    }
    ev.sort_by_key(|e| (e.0, e.1));
    let mut used = vec![0i64; layout.nr_nodes()];
    for (_, d, n) in ev {
        used[n as usize] += d;
        assert!(
            used[n as usize] <= layout.cpus(n) as i64,
            "{}: node {n} over capacity",
            out.policy
        );
    }
}

#[test]
fn trace_replay_is_deterministic_for_a_seed() {
    let (layout, w) = kth();
    for policy in [
        "random",
        "least-loaded",
        "pod:2",
        "sparrow:2",
        "ours",
        "ours+pack",
    ] {
        let a = run(&layout, &w, policy, 7, false);
        let b = run(&layout, &w, policy, 7, false);
        assert_eq!(a.records, b.records, "{policy}");
        assert_eq!(a.counters, b.counters, "{policy}");
        check_conservation(&layout, &w, &a);
    }
    let a = run(&layout, &w, "random", 7, false);
    let c = run(&layout, &w, "random", 8, false);
    assert_ne!(a.records, c.records, "another seed, other probes");
}

#[test]
fn cpu_level_runs_the_agents_scheduler() {
    let layout = Layout::new("1z:2r:4n", "2s:4c:2t").unwrap();
    let params = SyntheticParams {
        jobs: 400,
        load: 0.8,
        seed: 5,
        ..SyntheticParams::default()
    };
    let w = synthetic(&params, layout.capacity(), layout.min_node_cpus()).unwrap();
    for policy in ["least-loaded", "ours"] {
        let out = run(&layout, &w, policy, 1, true);
        check_conservation(&layout, &w, &out);
        let cpu = out.cpu.expect("CPU-level stats");
        assert_eq!(cpu.started, w.jobs.len() as u64, "{policy}");
        assert_eq!(cpu.refused, 0);
        assert!(cpu.multi > 0 && cpu.multi_one_numa > 0, "{cpu:?}");
        let again = run(&layout, &w, policy, 1, true);
        assert_eq!(out.records, again.records, "{policy}: deterministic");
    }
}

#[test]
fn ours_steals_and_keeps_pipelines_near_their_waker() {
    let layout = Layout::new("1z:4r:8n", "1s:4c:2t").unwrap();
    let params = SyntheticParams {
        jobs: 3000,
        load: 0.95,
        fanout_prob: 0.0,
        pipeline_prob: 0.3,
        seed: 11,
        ..SyntheticParams::default()
    };
    let w = synthetic(&params, layout.capacity(), layout.min_node_cpus()).unwrap();
    let ours = metrics::report(run(&layout, &w, "ours", 1, false), &w, &layout, 0);
    let no_steal = metrics::report(run(&layout, &w, "ours-steal", 1, false), &w, &layout, 0);
    let random = metrics::report(run(&layout, &w, "random", 1, false), &w, &layout, 0);
    assert!(ours.steals > 0 && no_steal.steals == 0);
    assert!(ours.counters.wake_affine > 0);
    assert!(
        ours.near_waker_rack_pct > random.near_waker_rack_pct + 20.0,
        "ours {} vs random {}",
        ours.near_waker_rack_pct,
        random.near_waker_rack_pct
    );
    assert!(
        ours.wait_mean_s <= no_steal.wait_mean_s,
        "stealing cuts waits"
    );
    assert!(ours.resp_mean_s < random.resp_mean_s);
    assert!(ours.makespan_s >= ours.makespan_lb_s);
}

/// The response floor is the workload's (the same for every policy, the
/// mean of each logical job's longest part, split parts grouped), no
/// policy's mean response goes below it, and at zero wait the two are
/// equal and the bounded slowdown is 1.
#[test]
fn the_response_floor_is_the_mean_run_time_and_bounds_every_policy() {
    let (layout, w) = kth();
    let mut longest: std::collections::BTreeMap<u32, u64> = Default::default();
    for j in &w.jobs {
        let e = longest.entry(j.group).or_default();
        *e = (*e).max(j.duration_us);
    }
    let oracle =
        longest.values().map(|&d| d as f64).sum::<f64>() / longest.len() as f64 / US_PER_S as f64;
    assert!(w.jobs.len() > longest.len(), "the excerpt has split jobs");
    for policy in ["least-loaded", "ours", "random"] {
        let r = metrics::report(run(&layout, &w, policy, 1, false), &w, &layout, 0);
        assert_eq!(r.unfinished, 0);
        assert!(
            (r.resp_floor_s - oracle).abs() < 1e-6 * oracle,
            "{policy}: {} vs {oracle}",
            r.resp_floor_s
        );
        assert!(r.resp_mean_s >= r.resp_floor_s, "{policy}");
    }
    // A cluster 20 times the trace's size: nothing waits.
    let big = Layout::new(&cluster_for(20 * layout.capacity() as u32, 4), "1s:2c:2t").unwrap();
    let r = metrics::report(run(&big, &w, "least-loaded", 1, false), &w, &big, 0);
    assert_eq!(r.wait_mean_s, 0.0);
    assert!((r.resp_mean_s - r.resp_floor_s).abs() < 1e-6 * oracle);
    assert_eq!(r.bsld_mean, 1.0);
}
