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
    (jobs[0].id.clone(), fx)
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
