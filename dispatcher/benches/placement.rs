//! Placement decisions per second in-process, at 1,000 / 10,000 / 100,000
//! nodes, against a least-loaded scan (Kubernetes' LeastAllocated: the node
//! with the most free CPUs that fits) measured in the same run.
//!
//! Both sides run the same steady-state loop on a cluster kept ~75% busy:
//! submit one job (1-8 CPUs), then finish one running job. "ours" is the
//! dispatcher's `Cluster::submit` (validation, job record, engine placement
//! on the node tree, CPU model, effects); the baseline only scans and
//! updates a free-CPU array, so the ratio flatters the baseline.
//!
//! `cargo bench -p dispatcher --bench placement` prints the table; under
//! `cargo test` (no `--bench` argument) it runs a tiny size once as a smoke
//! test.

use std::collections::HashMap;
use std::time::Instant;

use dispatcher::cluster::{Cluster, ClusterConfig, Effects};
use proto::v1::{JobSpec, JobState, JobStatus, Register};
use sched::Topology;

/// SplitMix64: a tiny seeded generator, so runs are reproducible.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

fn machine(spec: &str) -> proto::v1::Topology {
    engine_proto::topology(
        &Topology::from_spec(spec).unwrap_or_else(|e| panic!("bad spec {spec}: {e}")),
    )
}

const NODE_SPEC: &str = "2s:8c:2t";
const NODE_CPUS: u32 = 32;

fn cluster(nodes: usize) -> Cluster {
    let mut c = Cluster::new(ClusterConfig::default());
    let topo = machine(NODE_SPEC);
    let mut fx = Effects::default();
    let racks_per_zone = (nodes / 100 / 10).max(1);
    for i in 0..nodes {
        let rack = i / 100;
        let zone = rack / racks_per_zone;
        let mut labels = HashMap::new();
        labels.insert("topology.kubernetes.io/zone".into(), format!("z{zone}"));
        labels.insert("dispatch.io/rack".into(), format!("r{rack}"));
        c.register(
            Register {
                node: format!("n{i:06}"),
                labels,
                topology: Some(topo.clone()),
                ..Default::default()
            },
            0,
            &mut fx,
        )
        .unwrap_or_else(|e| panic!("register: {e}"));
    }
    c.settle(0, &mut fx);
    c
}

fn spec(cpus: u32) -> JobSpec {
    JobSpec {
        command: vec!["true".into()],
        cpus,
        ..Default::default()
    }
}

/// Ours: returns decisions per second over `ops` submits.
fn run_ours(nodes: usize, ops: usize) -> (f64, f64) {
    let t0 = Instant::now();
    let mut c = cluster(nodes);
    let setup = t0.elapsed().as_secs_f64();
    let mut rng = Rng(42);
    let target = (nodes as u64 * NODE_CPUS as u64) * 3 / 4;
    let mut used = 0u64;
    let mut running: Vec<(String, String, u32)> = Vec::new();
    let mut fx = Effects::default();
    // Fill to ~75%.
    while used < target {
        let cpus = 1 + rng.below(8) as u32;
        let jobs = c
            .submit(vec![spec(cpus)], false, 1, &mut fx)
            .unwrap_or_else(|e| panic!("{e}"));
        for j in jobs {
            if j.state == JobState::Assigned as i32 {
                used += cpus as u64;
                running.push((j.id, j.node, cpus));
            }
        }
        fx = Effects::default();
    }
    let start = Instant::now();
    for i in 0..ops {
        let cpus = 1 + rng.below(8) as u32;
        let jobs = c
            .submit(vec![spec(cpus)], false, 2 + i as i64, &mut fx)
            .unwrap_or_else(|e| panic!("{e}"));
        for j in jobs {
            if j.state == JobState::Assigned as i32 {
                running.push((j.id, j.node, cpus));
            }
        }
        if !running.is_empty() {
            let k = rng.below(running.len() as u64) as usize;
            let (id, node, _) = running.swap_remove(k);
            c.job_status(
                &node,
                JobStatus {
                    job_id: id,
                    attempt: 1,
                    state: JobState::Succeeded as i32,
                    ..Default::default()
                },
                2 + i as i64,
                &mut fx,
            );
            // Jobs the exit let start (queued ones, steals).
            for (_, msg) in fx.to_agents.drain(..) {
                if let Some(proto::v1::dispatcher_message::Msg::Assign(a)) = msg.msg
                    && let Ok(j) = c.get_job(&a.job_id)
                {
                    running.push((j.id, j.node, a.spec.map_or(1, |s| s.cpus)));
                }
            }
        }
        fx = Effects::default();
    }
    (ops as f64 / start.elapsed().as_secs_f64(), setup)
}

/// Baseline: least-loaded scan over a free-CPU array.
fn run_least_loaded(nodes: usize, ops: usize) -> f64 {
    let mut free = vec![NODE_CPUS; nodes];
    let mut rng = Rng(42);
    let target = (nodes as u64 * NODE_CPUS as u64) * 3 / 4;
    let mut used = 0u64;
    let mut running: Vec<(usize, u32)> = Vec::new();
    let place = |free: &mut Vec<u32>, cpus: u32| -> Option<usize> {
        let mut best: Option<usize> = None;
        for (i, &f) in free.iter().enumerate() {
            if f >= cpus && best.is_none_or(|b| f > free[b]) {
                best = Some(i);
            }
        }
        if let Some(b) = best {
            free[b] -= cpus;
        }
        best
    };
    while used < target {
        let cpus = 1 + rng.below(8) as u32;
        if let Some(n) = place(&mut free, cpus) {
            used += cpus as u64;
            running.push((n, cpus));
        }
    }
    let start = Instant::now();
    for _ in 0..ops {
        let cpus = 1 + rng.below(8) as u32;
        if let Some(n) = place(&mut free, cpus) {
            running.push((n, cpus));
        }
        if !running.is_empty() {
            let k = rng.below(running.len() as u64) as usize;
            let (n, c) = running.swap_remove(k);
            free[n] += c;
        }
    }
    ops as f64 / start.elapsed().as_secs_f64()
}

fn main() {
    let bench = std::env::args().any(|a| a == "--bench");
    let sizes: &[(usize, usize)] = if bench {
        &[(1_000, 20_000), (10_000, 20_000), (100_000, 5_000)]
    } else {
        &[(200, 500)]
    };
    println!(
        "placement decisions per second (steady state ~75% busy, jobs of 1-8 CPUs, nodes {NODE_SPEC})"
    );
    println!(
        "{:>8} {:>14} {:>16} {:>12} {:>10}",
        "nodes", "ours/s", "least-loaded/s", "ours/base", "setup s"
    );
    for &(nodes, ops) in sizes {
        let (ours, setup) = run_ours(nodes, ops);
        let base = run_least_loaded(nodes, ops);
        println!(
            "{nodes:>8} {ours:>14.0} {base:>16.0} {:>12.2} {setup:>10.2}",
            ours / base
        );
    }
}
