//! The cost of pending reasons on the read path: a ListJobs page of
//! waiting jobs with their reasons explained, against the same page without
//! them (what ListJobs cost before reasons existed), measured in the same
//! run; and the same for one GetJob of a job deep in a node's queue and
//! of a job no node matches.
//!
//! The cluster: `nodes` nodes of 32 CPUs (100 per rack), each running one
//! 32-CPU job and queueing `depth` more, plus one job per 100 nodes that no
//! node matches; EASY backfill on. Placement is not measured: reasons are
//! computed only when read.
//!
//! `cargo bench -p dispatcher --bench pending` prints the table. Under
//! `cargo test` (no `--bench`) it runs one small size and checks that every
//! listed waiting job got a reason.

use std::collections::HashMap;
use std::time::Instant;

use dispatcher::cluster::{Cluster, ClusterConfig, Effects};
use proto::v1::{JobSpec, ListJobsRequest, Register};
use sched::Topology;

fn cluster(nodes: usize, depth: usize) -> Cluster {
    let mut cfg = ClusterConfig::default();
    cfg.engine.backfill = true;
    let mut c = Cluster::new(cfg);
    let topo = engine_proto::topology(&Topology::from_spec("2s:8c:2t").expect("spec"));
    let mut fx = Effects::default();
    for i in 0..nodes {
        let rack = i / 100;
        let mut labels = HashMap::new();
        labels.insert(
            "topology.kubernetes.io/zone".into(),
            format!("z{}", rack / 10),
        );
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
    let job = |cpus: u32, timeout_ms: u64| JobSpec {
        command: vec!["true".into()],
        cpus,
        timeout_ms,
        ..Default::default()
    };
    let mut specs: Vec<JobSpec> = (0..nodes * (depth + 1))
        .map(|i| job(32, 60_000 + i as u64))
        .collect();
    specs.extend((0..nodes.div_ceil(100)).map(|_| job(64, 0)));
    for chunk in specs.chunks(10_000) {
        c.submit(chunk.to_vec(), true, 1, &mut fx)
            .unwrap_or_else(|e| panic!("submit: {e}"));
    }
    c.settle(1, &mut fx);
    c
}

/// Seconds per call of `f`, over `reps` calls.
fn time(reps: usize, mut f: impl FnMut()) -> f64 {
    let start = Instant::now();
    for _ in 0..reps {
        f();
    }
    start.elapsed().as_secs_f64() / reps as f64
}

fn main() {
    let bench = std::env::args().any(|a| a == "--bench");
    let sizes: &[(usize, usize, usize)] = if bench {
        &[(100, 20, 50), (1_000, 10, 20), (10_000, 2, 5)]
    } else {
        &[(50, 3, 1)]
    };
    println!(
        "ListJobs of up to 10,000 PENDING jobs, and GetJob of a queued and of an unmatched job, \
         without and with pending reasons (ms / us per call)"
    );
    println!(
        "{:>7} {:>6} {:>7} {:>9} {:>9} {:>6} {:>9} {:>9} {:>9} {:>9}",
        "nodes",
        "depth",
        "listed",
        "list",
        "+reasons",
        "ratio",
        "get q",
        "+reason",
        "get u",
        "+reason"
    );
    for &(nodes, depth, reps) in sizes {
        let c = cluster(nodes, depth);
        let req = ListJobsRequest {
            states: vec![proto::v1::JobState::Pending as i32],
            page_size: 10_000,
            ..Default::default()
        };
        let (page, _) = c.list_jobs(&req).expect("list");
        let base = time(reps, || {
            let (jobs, _) = c.list_jobs(&req).expect("list");
            std::hint::black_box(jobs);
        });
        let with = time(reps, || {
            let (mut jobs, _) = c.list_jobs(&req).expect("list");
            let mut why = c.explainer(2);
            jobs.iter_mut().for_each(|j| why.fill(j));
            std::hint::black_box(jobs);
        });
        let (mut jobs, _) = c.list_jobs(&req).expect("list");
        let mut why = c.explainer(2);
        jobs.iter_mut().for_each(|j| why.fill(j));
        let missing = jobs.iter().filter(|j| j.pending_reason.is_none()).count();
        assert_eq!(missing, 0, "listed waiting jobs without a reason");
        // GetJob of the newest queued job (deepest in its node's queue) and
        // of a job no node matches (counts every node's constraints).
        let get_reps = reps * 200;
        let get = |id: &str| {
            let base = time(get_reps, || {
                std::hint::black_box(c.get_job(id).expect("get"));
            });
            let with = time(get_reps, || {
                let mut j = c.get_job(id).expect("get");
                c.explainer(2).fill(&mut j);
                std::hint::black_box(j);
            });
            (base, with)
        };
        let pick = |cpus: u32| {
            page.iter()
                .find(|j| j.spec.as_ref().is_some_and(|s| s.cpus == cpus))
                .map(|j| j.id.clone())
                .expect("a waiting job")
        };
        let (queued, queued_with) = get(&pick(32));
        let (unplaced, unplaced_with) = get(&pick(64));
        println!(
            "{nodes:>7} {depth:>6} {:>7} {:>9.2} {:>9.2} {:>6.1} {:>9.1} {:>9.1} {:>9.1} {:>9.1}",
            page.len(),
            base * 1e3,
            with * 1e3,
            with / base,
            queued * 1e6,
            queued_with * 1e6,
            unplaced * 1e6,
            unplaced_with * 1e6,
        );
    }
}
