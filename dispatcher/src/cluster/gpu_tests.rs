//! GPUs at cluster level: a job asking for GPUs goes only to a node with
//! that many free, waits `no_match_gpus` when no node has that many at
//! all and `gpus_busy` while they are all taken, and starts when a job
//! frees them; the node view counts them.

use std::collections::HashMap;

use proto::v1::{
    Device, DeviceKind, JobSpec, JobState, JobStatus, PendingReasonKind as Kind, Register,
};

use super::tests::{assigns, finish_on, machine};
use super::*;

/// Register `name` (a 2-socket machine) with `gpus` GPUs in rack r1.
fn node(c: &mut Cluster, name: &str, gpus: u32) {
    let devices = (0..gpus)
        .map(|i| Device {
            kind: DeviceKind::Gpu as i32,
            index: i,
            numa_node: Some(i * 2 / gpus.max(1)),
            ..Default::default()
        })
        .chain([Device {
            kind: DeviceKind::Nic as i32,
            ..Default::default()
        }])
        .collect();
    let mut labels = HashMap::new();
    labels.insert("topology.kubernetes.io/zone".to_string(), "z1".into());
    labels.insert("dispatch.io/rack".to_string(), "r1".into());
    let mut fx = Effects::default();
    c.register(
        Register {
            node: name.into(),
            labels,
            topology: Some(machine("2s:4c:1t")),
            devices,
            ..Default::default()
        },
        0,
        &mut fx,
    )
    .unwrap();
    c.settle(0, &mut fx);
}

fn job(cpus: u32, gpus: u32) -> JobSpec {
    JobSpec {
        command: vec!["true".into()],
        cpus,
        gpus,
        ..Default::default()
    }
}

fn submit(c: &mut Cluster, spec: JobSpec, now: i64) -> (String, Effects) {
    let mut fx = Effects::default();
    let jobs = c.submit(vec![spec], false, now, &mut fx).unwrap();
    c.settle(now, &mut fx);
    c.check().unwrap();
    (jobs[0].id(), fx)
}

fn kind(c: &Cluster, id: &str) -> (Kind, String) {
    let r = c.pending_reason(id, 10).expect("waiting");
    (r.kind(), r.message)
}

#[test]
fn gpu_jobs_skip_nodes_without_and_wait_for_free_gpus() {
    let mut c = Cluster::new(ClusterConfig::default());
    node(&mut c, "cpu-only", 0);
    // No node has GPUs: no_match_gpus, counted like the other kinds.
    let (j1, fx) = submit(&mut c, job(1, 2), 1);
    assert!(assigns(&fx).is_empty());
    let (k, msg) = kind(&c, &j1);
    assert_eq!(k, Kind::NoMatchGpus, "{msg}");
    assert!(
        msg.contains("0/1 nodes match: 1 have fewer than 2 GPUs (largest 0)"),
        "{msg}"
    );
    // A 4-GPU node registers: the waiting job goes there, not to the
    // emptier CPU-only node.
    node(&mut c, "gpu", 4);
    assert_eq!(
        c.phase(&j1).and_then(|p| p.node()),
        Some("gpu"),
        "{:?}",
        c.phase(&j1)
    );
    // Jobs without GPUs still go anywhere; a second 2-GPU job takes the
    // other two GPUs.
    let (j2, fx) = submit(&mut c, job(1, 2), 2);
    assert_eq!(assigns(&fx), vec![("gpu".to_string(), j2.clone())]);
    let view = c.node_proto(c.node("gpu").unwrap());
    assert_eq!((view.gpus, view.gpus_free), (4, 0));
    assert_eq!(view.devices.len(), 5);
    // All four taken: a third waits (gpus_busy) although CPUs are free.
    let (j3, fx) = submit(&mut c, job(1, 1), 3);
    assert!(assigns(&fx).is_empty(), "{:?}", assigns(&fx));
    let (k, msg) = kind(&c, &j3);
    assert_eq!(k, Kind::GpusBusy, "{msg}");
    assert!(
        msg.contains("1 node has that many (gpu 0 of 4 free)"),
        "{msg}"
    );
    // The running GPU job reports its GPUs; when it ends, j3 starts there.
    let mut fx = Effects::default();
    let running = JobStatus {
        job_id: j1.clone(),
        attempt: 1,
        state: JobState::Running as i32,
        cpus: vec![0],
        gpus: vec![0, 1],
        ..Default::default()
    };
    c.job_status("gpu", running, 4, &mut fx);
    assert_eq!(c.get_job(&j1).unwrap().gpus, vec![0, 1]);
    let fx = finish_on(&mut c, "gpu", &j1, 5);
    assert_eq!(assigns(&fx), vec![("gpu".to_string(), j3.clone())]);
    c.check().unwrap();
    assert_eq!(
        c.get_job(&j1).unwrap().gpus,
        vec![0, 1],
        "kept after the end"
    );
    let view = c.node_proto(c.node("gpu").unwrap());
    assert_eq!(view.gpus_free, 1);
    // More GPUs than any node has: no_match_gpus at once.
    let (j4, _) = submit(&mut c, job(1, 5), 6);
    assert_eq!(kind(&c, &j4).0, Kind::NoMatchGpus);
}

/// A job without GPUs never counts against a node's GPUs, and a GPU job
/// cancelled while it waits for GPUs leaves nothing behind.
#[test]
fn cancelled_gpu_waiter_and_cpu_jobs_hold_no_gpus() {
    let mut c = Cluster::new(ClusterConfig::default());
    node(&mut c, "gpu", 1);
    let (_cpu, _) = submit(&mut c, job(2, 0), 1);
    assert_eq!(c.node_proto(c.node("gpu").unwrap()).gpus_free, 1);
    let (g1, _) = submit(&mut c, job(1, 1), 2);
    let (g2, _) = submit(&mut c, job(1, 1), 3);
    assert_eq!(kind(&c, &g2).0, Kind::GpusBusy);
    let mut fx = Effects::default();
    c.cancel(&g2, 4, &mut fx).unwrap();
    c.check().unwrap();
    let fx = finish_on(&mut c, "gpu", &g1, 5);
    assert!(assigns(&fx).is_empty(), "the cancelled waiter stays ended");
    assert_eq!(c.node_proto(c.node("gpu").unwrap()).gpus_free, 1);
}

mod prop {
    use proptest::prelude::*;

    use super::*;

    #[derive(Clone, Debug)]
    enum Op {
        Submit { cpus: u32, gpus: u32 },
        Run(usize),
        Finish(usize),
        Cancel(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (1u32..4, 0u32..4).prop_map(|(cpus, gpus)| Op::Submit { cpus, gpus }),
            2 => (0usize..64).prop_map(Op::Run),
            2 => (0usize..64).prop_map(Op::Finish),
            1 => (0usize..64).prop_map(Op::Cancel),
        ]
    }

    /// The GPUs taken on each node, recomputed from every job's phase and
    /// spec (not from the index placement reads).
    fn taken(c: &Cluster) -> HashMap<String, u32> {
        let mut out = HashMap::new();
        for (_, e) in c.jobs.iter() {
            if let Some(n) = e.phase().node() {
                *out.entry(n.to_string()).or_default() +=
                    e.job().spec.as_ref().map_or(0, |s| s.gpus);
            }
        }
        out
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(200))]
        /// Against the brute-force count after every step: no node ever
        /// has more GPUs taken than it has; a job waits `gpus_busy` only
        /// while no node with that many GPUs has them free; a job never
        /// sits on a node with fewer GPUs than it asks for.
        #[test]
        fn gpus_are_never_overcommitted_and_waiters_start_when_they_can(
            ops in proptest::collection::vec(op(), 1..60),
        ) {
            let mut c = Cluster::new(ClusterConfig::default());
            node(&mut c, "a", 2);
            node(&mut c, "b", 4);
            node(&mut c, "none", 0);
            let mut ids: Vec<String> = Vec::new();
            for (t, op) in ops.into_iter().enumerate() {
                let now = 10 + t as i64;
                let mut fx = Effects::default();
                match op {
                    Op::Submit { cpus, gpus } => {
                        let jobs = c.submit(vec![job(cpus, gpus)], false, now, &mut fx).unwrap();
                        ids.push(jobs[0].id());
                    }
                    Op::Run(i) | Op::Finish(i) | Op::Cancel(i) if ids.is_empty() => {
                        let _ = i;
                    }
                    Op::Run(i) => {
                        let id = &ids[i % ids.len()];
                        if let Some(Phase::Assigned { node, .. }) = c.phase(id).cloned() {
                            let st = JobStatus {
                                job_id: id.clone(),
                                attempt: 1,
                                state: JobState::Running as i32,
                                ..Default::default()
                            };
                            c.job_status(&node, st, now, &mut fx);
                        }
                    }
                    Op::Finish(i) => {
                        let id = ids[i % ids.len()].clone();
                        if let Some(node) = c.phase(&id).and_then(|p| p.on_node()).map(str::to_string) {
                            fx = finish_on(&mut c, &node, &id, now);
                        }
                    }
                    Op::Cancel(i) => {
                        let id = ids[i % ids.len()].clone();
                        let _ = c.cancel(&id, now, &mut fx);
                    }
                }
                c.settle(now, &mut fx);
                prop_assert!(c.check().is_ok(), "{:?}", c.check());
                let taken = taken(&c);
                for n in c.nodes() {
                    let t = taken.get(n.name.as_str()).copied().unwrap_or(0);
                    prop_assert!(t <= n.gpus, "{}: {t} GPUs taken of {}", n.name, n.gpus);
                }
                for id in &ids {
                    let Some(e) = JobKey::parse(id).and_then(|k| c.jobs.get(k)) else {
                        continue;
                    };
                    let want = e.gpus();
                    if let Some(n) = e.phase().node() {
                        prop_assert!(c.node(n).unwrap().gpus >= want, "{id} on {n}");
                    }
                    if matches!(e.phase(), Phase::Unplaced { why: Unplaced::GpusBusy { .. } }) {
                        for n in c.nodes() {
                            let free = n.gpus - taken.get(n.name.as_str()).copied().unwrap_or(0);
                            prop_assert!(
                                n.gpus < want || free < want,
                                "{id} waits for {want} GPUs but {} has {free} free",
                                n.name
                            );
                        }
                    }
                }
            }
        }
    }
}
