//! Unit tests of the job lifecycle on the cluster state, driven the way the
//! core drives it (register, submit, statuses, ticks), with no I/O.

use std::collections::HashMap;

use proto::v1::{JobSpec, JobStatus, NodeLoad, NodeState, Register, dispatcher_message};
use sched::Topology;

use super::*;
use crate::store::NodeAdmin;

/// The API topology of a synthetic machine.
pub(crate) fn machine(spec: &str) -> proto::v1::Topology {
    engine_proto::topology(&Topology::from_spec(spec).unwrap())
}

/// Attempt 1 of job `id` on `node` succeeded at `now`: what it caused.
pub(crate) fn finish_on(c: &mut Cluster, node: &str, id: &str, now: i64) -> Effects {
    let mut fx = Effects::default();
    let status = proto::v1::JobStatus {
        job_id: id.into(),
        attempt: 1,
        state: proto::v1::JobState::Succeeded as i32,
        ..Default::default()
    };
    c.job_status(node, status, now, &mut fx);
    fx
}

/// Register node `name` with machine `spec` in rack `rack` of zone `z1`
/// at time 0 and settle what it causes.
pub(crate) fn node_in_rack(c: &mut Cluster, name: &str, spec: &str, rack: &str) {
    let mut fx = Effects::default();
    register_node(c, name, spec, ("z1", rack), 0, &mut fx);
    c.settle(0, &mut fx);
}

/// Register node `name` with a synthetic machine `spec` in `zone`/`rack`
/// (the default labels), appending what it causes to `fx`.
pub(crate) fn register_node(
    c: &mut Cluster,
    name: &str,
    spec: &str,
    (zone, rack): (&str, &str),
    now: i64,
    fx: &mut Effects,
) {
    register_node_with_jobs(c, name, spec, (zone, rack), Vec::new(), now, fx);
}

/// [`register_node`], the agent reporting `jobs` (a restart's re-adoption).
pub(crate) fn register_node_with_jobs(
    c: &mut Cluster,
    name: &str,
    spec: &str,
    (zone, rack): (&str, &str),
    jobs: Vec<JobStatus>,
    now: i64,
    fx: &mut Effects,
) {
    let mut labels = HashMap::new();
    labels.insert("topology.kubernetes.io/zone".to_string(), zone.to_string());
    labels.insert("dispatch.io/rack".to_string(), rack.to_string());
    c.register(
        Register {
            node: name.into(),
            labels,
            topology: Some(machine(spec)),
            jobs,
            ..Default::default()
        },
        now,
        fx,
    )
    .unwrap();
}

fn register(c: &mut Cluster, name: &str, spec: &str, zone: &str, rack: &str, now: i64) -> Effects {
    let mut fx = Effects::default();
    register_node(c, name, spec, (zone, rack), now, &mut fx);
    c.settle(now, &mut fx);
    fx
}

fn job(cpus: u32) -> JobSpec {
    JobSpec {
        command: vec!["true".into()],
        cpus,
        ..Default::default()
    }
}

/// A one-command job of `cpus` CPUs with a time limit of `timeout_s`
/// seconds (0: none), the shape the work-conservation, domain and gang
/// tests submit.
pub(crate) fn job_with_limit(cpus: u32, timeout_s: u64) -> JobSpec {
    JobSpec {
        command: vec!["true".into()],
        cpus,
        timeout_ms: timeout_s * 1000,
        ..Default::default()
    }
}

/// The node job `id`'s phase holds or waits on ("" when none).
pub(crate) fn node_of(c: &Cluster, id: &str) -> String {
    c.phase(id)
        .and_then(|p| p.node())
        .unwrap_or_default()
        .to_string()
}

pub(crate) fn assigns(fx: &Effects) -> Vec<(String, String)> {
    fx.to_agents
        .iter()
        .filter_map(|(n, m)| match &m.message().msg {
            Some(dispatcher_message::Msg::Assign(a)) => Some((n.to_string(), a.job_id.clone())),
            _ => None,
        })
        .collect()
}

fn status(id: &str, attempt: u32, state: JobState) -> JobStatus {
    JobStatus {
        job_id: id.into(),
        attempt,
        state: state as i32,
        ..Default::default()
    }
}

fn state_of(c: &Cluster, id: &str) -> JobState {
    JobState::try_from(c.get_job(id).unwrap().state).unwrap()
}

#[test]
fn submit_assign_run_finish_then_queued_job_starts() {
    let mut c = Cluster::new(ClusterConfig::default());
    register(&mut c, "n1", "1s:2c:1t", "z1", "r1", 0);
    let mut fx = Effects::default();
    let jobs = c.submit(vec![job(2), job(2)], true, 1, &mut fx).unwrap();
    assert_eq!(jobs.len(), 2);
    assert_eq!(assigns(&fx), vec![("n1".to_string(), "j-1".to_string())]);
    assert_eq!(state_of(&c, "j-1"), JobState::Assigned);
    assert_eq!(state_of(&c, "j-2"), JobState::Pending);
    assert!(c.get_job("j-2").unwrap().reason.contains("queued on n1"));
    // Persist before acknowledge: every created job is in the writes.
    c.write_back(&mut fx);
    let puts = fx
        .writes
        .iter()
        .filter(|w| matches!(w, Write::PutJob(_)))
        .count();
    assert!(puts >= 2);
    let mut fx = Effects::default();
    c.job_status("n1", status("j-1", 1, JobState::Running), 2, &mut fx);
    assert_eq!(state_of(&c, "j-1"), JobState::Running);
    let mut fx = Effects::default();
    c.job_status("n1", status("j-1", 1, JobState::Succeeded), 3, &mut fx);
    assert_eq!(state_of(&c, "j-1"), JobState::Succeeded);
    assert_eq!(assigns(&fx), vec![("n1".to_string(), "j-2".to_string())]);
}

/// A batch's changes to a job change its record in place when nobody
/// reads the batch's events: the store's write of it is made once, at
/// the batch's end, in its last state. With events, each event keeps its
/// change's record (the next change copies it).
#[test]
fn a_batch_changes_a_record_in_place_and_writes_it_once() {
    for drop_events in [true, false] {
        let mut c = Cluster::new(ClusterConfig::default());
        register(&mut c, "n1", "1s:2c:1t", "z1", "r1", 0);
        let mut fx = Effects {
            drop_events,
            ..Effects::default()
        };
        drop(c.submit(vec![job(1)], false, 1, &mut fx).unwrap());
        // The agent has its Assign (which shares the record) before it
        // answers.
        assert_eq!(assigns(&fx), [("n1".to_string(), "j-1".to_string())]);
        fx.to_agents.clear();
        let key = JobKey::single(1);
        let at = |c: &Cluster| Arc::as_ptr(&c.jobs.record(key).unwrap());
        let created = at(&c);
        c.job_status("n1", status("j-1", 1, JobState::Running), 2, &mut fx);
        c.job_status("n1", status("j-1", 1, JobState::Succeeded), 3, &mut fx);
        assert_eq!(state_of(&c, "j-1"), JobState::Succeeded);
        assert_eq!(at(&c) == created, drop_events, "drop_events {drop_events}");
        let states: Vec<i32> = fx.events.iter().map(|e| e.job.state).collect();
        if drop_events {
            assert!(states.is_empty());
        } else {
            let want = [JobState::Running, JobState::Succeeded].map(|s| s as i32);
            assert_eq!(
                states[states.len() - 2..],
                want,
                "each event as its change left it"
            );
        }
        assert!(
            !fx.writes.iter().any(|w| matches!(w, Write::PutJob(_))),
            "no job's write before the batch's end"
        );
        c.write_back(&mut fx);
        let puts: Vec<(String, i32)> = fx
            .writes
            .iter()
            .filter_map(|w| match w {
                Write::PutJob(j) => Some((j.id(), j.state)),
                _ => None,
            })
            .collect();
        assert_eq!(puts, [("j-1".to_string(), JobState::Succeeded as i32)]);
        assert!(fx.dirty.is_empty());
    }
}

#[test]
fn bad_specs_create_nothing() {
    let mut c = Cluster::new(ClusterConfig::default());
    register(&mut c, "n1", "1s:2c:1t", "z1", "r1", 0);
    let mut fx = Effects::default();
    let mut bad = job(1);
    bad.latency_nice = 99;
    let err = c.submit(vec![job(1), bad], true, 1, &mut fx).unwrap_err();
    assert_eq!(err.code(), tonic::Code::InvalidArgument);
    assert!(
        err.message().starts_with("specs[1].latency_nice"),
        "{}",
        err.message()
    );
    assert_eq!(c.nr_jobs(), 0);
    assert!(fx.writes.is_empty() && fx.dirty.is_empty());
    let mut w = job(1);
    w.waker = "j-77".into();
    let err = c.submit(vec![w], false, 1, &mut fx).unwrap_err();
    assert!(err.message().starts_with("spec.waker"), "{}", err.message());
    assert_eq!(c.get_job("j-9").unwrap_err().code(), tonic::Code::NotFound);
    assert_eq!(
        c.get_job("bogus").unwrap_err().code(),
        tonic::Code::NotFound
    );
}

#[test]
fn alignment_and_selector_are_respected() {
    let mut c = Cluster::new(ClusterConfig::default());
    // Two LLCs of 4 CPUs each on n-small; one LLC of 8 on n-big.
    register(&mut c, "n-small", "2s:4c:1t", "z1", "r1", 0);
    register(&mut c, "n-big", "1s:8c:1t", "z1", "r1", 0);
    let mut fx = Effects::default();
    let mut j = job(6);
    j.alignment = proto::v1::Alignment::Llc as i32;
    c.submit(vec![j], false, 1, &mut fx).unwrap();
    assert_eq!(assigns(&fx), vec![("n-big".to_string(), "j-1".to_string())]);
    let mut j = job(1);
    j.node_selector
        .insert("dispatch.io/rack".into(), "nowhere".into());
    c.submit(vec![j], false, 2, &mut fx).unwrap();
    let pending = c.get_job("j-2").unwrap();
    assert_eq!(
        JobState::try_from(pending.state).unwrap(),
        JobState::Pending
    );
    assert!(
        pending.reason.contains("no node matches"),
        "{}",
        pending.reason
    );
    // A node with the label arrives: the job is placed there.
    let mut fx = Effects::default();
    let mut labels = HashMap::new();
    labels.insert("dispatch.io/rack".to_string(), "nowhere".to_string());
    c.register(
        Register {
            node: "n-far".into(),
            labels,
            topology: Some(machine("1s:2c:1t")),
            ..Default::default()
        },
        3,
        &mut fx,
    )
    .unwrap();
    c.settle(3, &mut fx);
    assert_eq!(assigns(&fx), vec![("n-far".to_string(), "j-2".to_string())]);
}

#[test]
fn idle_node_steals_from_overloaded_node_of_its_rack() {
    for limit in [1, 2] {
        steal_within_node_limit(limit);
    }
}

fn steal_within_node_limit(limit: usize) {
    let mut cfg = ClusterConfig::default();
    cfg.engine.steal_node_limit = limit;
    let mut c = Cluster::new(cfg);
    register(&mut c, "a", "1s:2c:1t", "z1", "r1", 0);
    register(&mut c, "b", "1s:2c:1t", "z1", "r1", 0);
    register(&mut c, "far", "1s:2c:1t", "z2", "r9", 0);
    let mut fx = Effects::default();
    c.set_node_admin("b", NodeAdmin::Cordoned, 0, &mut fx)
        .unwrap();
    c.set_node_admin("far", NodeAdmin::Cordoned, 0, &mut fx)
        .unwrap();
    // Only a takes jobs: one runs, two queue on it.
    let mut fx = Effects::default();
    c.submit(vec![job(2), job(2), job(2)], true, 1, &mut fx)
        .unwrap();
    assert_eq!(assigns(&fx), vec![("a".to_string(), "j-1".to_string())]);
    assert!(c.engine().unwrap().rq(0).is_overloaded());
    // b comes back idle: it steals a queued job from a, its rack peer.
    let mut fx = Effects::default();
    c.set_node_admin("b", NodeAdmin::Ready, 2, &mut fx).unwrap();
    let started = assigns(&fx);
    assert_eq!(started.len(), 1, "{started:?}");
    assert_eq!(started[0].0, "b");
    assert_eq!(c.engine().unwrap().stats().steal, 1);
    let j = c.get_job(&started[0].1).unwrap();
    assert!(
        j.reason
            .contains("steal: b took it from overloaded a (same rack)"),
        "{}",
        j.reason
    );
    // far is in another zone: with a node limit of 1 zone it may not
    // steal across zones; with the default limit of 2 it may.
    let mut fx = Effects::default();
    c.set_node_admin("far", NodeAdmin::Ready, 3, &mut fx)
        .unwrap();
    if limit == 1 {
        assert!(assigns(&fx).is_empty());
        assert_eq!(c.engine().unwrap().stats().steal, 1);
    } else {
        let started = assigns(&fx);
        assert_eq!(started.len(), 1);
        let j = c.get_job(&started[0].1).unwrap();
        assert!(
            j.reason.contains("from overloaded a (another zone)"),
            "{}",
            j.reason
        );
    }
}

/// The core times steals by the difference of `Cluster::steals` around
/// each message; a node joining rebuilds the engine, whose own count starts
/// again at 0, and the cluster's count must not go back (it did, and the
/// core's subtraction overflowed on a new leader's first registrations).
#[test]
fn the_steal_count_survives_an_engine_rebuild() {
    let mut c = Cluster::new(ClusterConfig::default());
    register(&mut c, "a", "1s:2c:1t", "z1", "r1", 0);
    register(&mut c, "b", "1s:2c:1t", "z1", "r1", 0);
    let mut fx = Effects::default();
    c.set_node_admin("b", NodeAdmin::Cordoned, 0, &mut fx)
        .unwrap();
    c.submit(vec![job(2), job(2), job(2)], true, 1, &mut fx)
        .unwrap();
    c.set_node_admin("b", NodeAdmin::Ready, 2, &mut fx).unwrap();
    let before = c.steals();
    assert_eq!(before, 1);
    register(&mut c, "late", "1s:2c:1t", "z1", "r2", 3);
    c.settle(3, &mut fx);
    assert!(c.steals() >= before, "{} < {before}", c.steals());
}

#[test]
fn node_loss_retries_within_budget_else_lost() {
    let mut c = Cluster::new(ClusterConfig::default());
    register(&mut c, "a", "1s:2c:1t", "z1", "r1", 0);
    let mut fx = Effects::default();
    let mut retried = job(2);
    retried.retries = 1;
    c.submit(vec![retried, job(2)], true, 1, &mut fx).unwrap();
    c.job_status("a", status("j-1", 1, JobState::Running), 2, &mut fx);
    register(&mut c, "b", "1s:2c:1t", "z1", "r1", 2);
    // Heartbeats: b reports, a does not.
    for t in [1000, 2000, 3000, 4000] {
        c.load_report("b", NodeLoad::default(), t, &mut Effects::default());
        let mut fx = Effects::default();
        c.tick(t, &mut fx);
    }
    let j1 = c.get_job("j-1").unwrap();
    assert_eq!(j1.attempt, 2, "{j1:?}");
    assert_eq!(j1.node, "b");
    assert!(j1.reason.contains("node a lost"), "{}", j1.reason);
    // j-2 was queued on a or running on b; either way it is not lost.
    assert_ne!(state_of(&c, "j-2"), JobState::Lost);
    assert_eq!(c.node("a").unwrap().state(), NodeState::Down);
    // A job with no retries on a lost node is LOST.
    let mut c = Cluster::new(ClusterConfig::default());
    register(&mut c, "a", "1s:2c:1t", "z1", "r1", 0);
    let mut fx = Effects::default();
    c.submit(vec![job(1)], false, 1, &mut fx).unwrap();
    c.tick(10_000, &mut fx);
    assert_eq!(state_of(&c, "j-1"), JobState::Lost);
}

#[test]
fn cancel_pending_running_and_arrays() {
    let mut c = Cluster::new(ClusterConfig::default());
    register(&mut c, "a", "1s:1c:1t", "z1", "r1", 0);
    let mut fx = Effects::default();
    c.submit(vec![job(1), job(1)], true, 1, &mut fx).unwrap();
    let mut fx = Effects::default();
    c.cancel("j-2", 2, &mut fx).unwrap();
    assert_eq!(state_of(&c, "j-2"), JobState::Cancelled);
    let mut fx = Effects::default();
    c.cancel("j-1", 3, &mut fx).unwrap();
    assert!(
        fx.to_agents
            .iter()
            .any(|(_, m)| matches!(m.message().msg, Some(dispatcher_message::Msg::Cancel(_))))
    );
    assert_eq!(
        state_of(&c, "j-1"),
        JobState::Assigned,
        "until the agent confirms"
    );
    c.job_status("a", status("j-1", 1, JobState::Cancelled), 4, &mut fx);
    assert_eq!(state_of(&c, "j-1"), JobState::Cancelled);
    // Arrays.
    let mut arr = job(1);
    arr.array_count = 5;
    let created = c.submit(vec![arr], false, 5, &mut fx).unwrap();
    assert_eq!(created.len(), 5);
    assert_eq!(created[4].id(), "j-3.4");
    assert_eq!(c.get_job("j-3").unwrap_err().code(), tonic::Code::NotFound);
    c.cancel("j-3", 6, &mut fx).unwrap();
    let pending = (0..5)
        .filter(|i| state_of(&c, &format!("j-3.{i}")) == JobState::Pending)
        .count();
    assert_eq!(pending, 0);
}

#[test]
fn list_pages_newest_first() {
    let mut c = Cluster::new(ClusterConfig::default());
    let mut fx = Effects::default();
    c.submit((0..25).map(|_| job(1)).collect(), true, 1, &mut fx)
        .unwrap();
    let mut seen = Vec::new();
    let mut token = String::new();
    loop {
        let (page, next) = c
            .list_jobs(&ListJobsRequest {
                page_size: 10,
                page_token: token.clone(),
                ..Default::default()
            })
            .unwrap();
        seen.extend(page.into_iter().map(|j| j.id));
        if next.is_empty() {
            break;
        }
        token = next;
    }
    assert_eq!(seen.len(), 25);
    assert_eq!(seen[0], "j-25");
    assert_eq!(seen[24], "j-1");
    assert!(
        c.list_jobs(&ListJobsRequest {
            page_token: "zz".into(),
            ..Default::default()
        })
        .is_err()
    );
}

#[test]
fn restore_reconciles_with_agents() {
    let mut c = Cluster::new(ClusterConfig::default());
    register(&mut c, "a", "1s:2c:1t", "z1", "r1", 0);
    let mut fx = Effects::default();
    c.submit(vec![job(1), job(1), job(1)], true, 1, &mut fx)
        .unwrap();
    c.job_status("a", status("j-1", 1, JobState::Running), 2, &mut fx);
    // Snapshot what the store would hold.
    let snap = Snapshot {
        jobs: c.jobs_matching(&[]),
        node_admin: HashMap::new(),
        next_job: 4,
    };
    let mut d = Cluster::new(ClusterConfig::default());
    d.restore(snap, 100, 5_000);
    // The agent comes back and reports j-1 still running; j-2 (assigned)
    // is not reported, so it is re-sent.
    let mut fx = Effects::default();
    let mut labels = HashMap::new();
    labels.insert("topology.kubernetes.io/zone".to_string(), "z1".to_string());
    labels.insert("dispatch.io/rack".to_string(), "r1".to_string());
    d.register(
        Register {
            node: "a".into(),
            labels,
            topology: Some(machine("1s:2c:1t")),
            jobs: vec![status("j-1", 1, JobState::Running)],
            ..Default::default()
        },
        200,
        &mut fx,
    )
    .unwrap();
    d.settle(200, &mut fx);
    assert_eq!(state_of(&d, "j-1"), JobState::Running);
    assert!(
        assigns(&fx).contains(&("a".to_string(), "j-2".to_string())),
        "{:?}",
        assigns(&fx)
    );
    d.load_report("a", NodeLoad::default(), 5_500, &mut Effects::default());
    let mut fx = Effects::default();
    d.tick(6_000, &mut fx);
    assert_ne!(state_of(&d, "j-1"), JobState::Lost);
    // j-2 was restored as ASSIGNED but the agent did not report it: the
    // Assign was sent again (it may have been lost in the crash).
    assert_eq!(state_of(&d, "j-2"), JobState::Assigned);
    // j-3 was pending and is placed again.
    assert_ne!(state_of(&d, "j-3"), JobState::Lost);
    let mut fx = Effects::default();
    let j = d.submit(vec![job(1)], false, 7_000, &mut fx).unwrap();
    assert_eq!(j[0].id(), "j-4", "ids continue after a restart");
}

/// The job table lists a node's jobs under the registry slot its name
/// carries (names the registry handed out: placements), or under the
/// name when it has none (restored from the store before the node
/// registered); a node's jobs may be under both, and every reader takes
/// both. After a restart the nodes register in another order, so their
/// slots differ from the first dispatcher's: a slot only ever names the
/// node whose registration made it (`Cluster::check`).
#[test]
fn a_nodes_jobs_are_found_by_its_slot_and_by_its_name() {
    let mut c = Cluster::new(ClusterConfig::default());
    register(&mut c, "a", "1s:2c:1t", "z1", "r1", 0);
    register(&mut c, "b", "1s:2c:1t", "z1", "r1", 0);
    let mut fx = Effects::default();
    c.submit(vec![job(1); 4], true, 1, &mut fx).unwrap();
    let on = |c: &Cluster, n: &str| -> Vec<String> {
        ["j-1", "j-2", "j-3", "j-4", "j-5"]
            .into_iter()
            .filter(|id| c.get_job(id).is_ok() && node_of(c, id) == n)
            .map(str::to_string)
            .collect()
    };
    let (on_a, on_b) = (on(&c, "a"), on(&c, "b"));
    assert_eq!((on_a.len(), on_b.len()), (2, 2), "{on_a:?} {on_b:?}");
    let snap = Snapshot {
        jobs: c.jobs_matching(&[]),
        node_admin: HashMap::new(),
        next_job: 5,
    };
    let mut d = Cluster::new(ClusterConfig::default());
    d.restore(snap, 100, 5_000);
    let mut fx = Effects::default();
    // "b" registers first: it takes the slot "a" had.
    for (name, ids) in [("b", &on_b), ("a", &on_a)] {
        let jobs = ids
            .iter()
            .map(|id| status(id, 1, JobState::Running))
            .collect();
        register_node_with_jobs(&mut d, name, "1s:2c:1t", ("z1", "r1"), jobs, 200, &mut fx);
        d.settle(200, &mut fx);
        d.check().unwrap();
    }
    assert_eq!(d.nodes.slot("b").map(NodeSlot::index), Some(0));
    let keys = |ids: &[String]| -> Vec<JobKey> {
        let mut k: Vec<JobKey> = ids.iter().filter_map(|id| JobKey::parse(id)).collect();
        k.sort_unstable();
        k
    };
    assert_eq!(d.jobs.on("a", d.nodes.slot("a")), keys(&on_a));
    // One of a's jobs ends; the next job is placed there (b is full),
    // under a's slot, beside the restored one listed by name.
    let mut fx = Effects::default();
    d.job_status("a", status(&on_a[0], 1, JobState::Succeeded), 300, &mut fx);
    let j = d.submit(vec![job(1)], false, 300, &mut fx).unwrap();
    d.settle(300, &mut fx);
    d.check().unwrap();
    let now_on_a = vec![on_a[1].clone(), j[0].id()];
    assert_eq!(on(&d, "a"), now_on_a);
    assert_eq!(d.jobs.on("a", d.nodes.slot("a")), keys(&now_on_a));
    assert_eq!(d.jobs.on("b", d.nodes.slot("b")), keys(&on_b));
    // "a" misses its heartbeats: both of its jobs are found and leave it.
    let mut fx = Effects::default();
    d.load_report("b", NodeLoad::default(), 20_000, &mut fx);
    d.tick(20_000, &mut fx);
    d.check().unwrap();
    assert_eq!(d.jobs.on("a", d.nodes.slot("a")), Vec::<JobKey>::new());
    for id in &now_on_a {
        assert_ne!(state_of(&d, id), JobState::Running, "{id}");
    }
}

/// A lost node's capacity shrinks to what its remaining jobs hold before
/// any of its jobs is retried: no retry is ASSIGNED to the DOWN node.
#[test]
fn retries_after_node_loss_never_go_back_to_the_lost_node() {
    let mut c = Cluster::new(ClusterConfig::default());
    register(&mut c, "a1", "1s:2c:2t", "z1", "r1", 0);
    register(&mut c, "a2", "1s:2c:2t", "z1", "r1", 0);
    let mut fx = Effects::default();
    c.set_node_admin("a2", NodeAdmin::Cordoned, 0, &mut fx)
        .unwrap();
    let specs = (0..4)
        .map(|i| JobSpec {
            retries: i % 2,
            ..job(1)
        })
        .collect();
    c.submit(specs, true, 1, &mut fx).unwrap();
    for i in 1..=4 {
        c.job_status(
            "a1",
            status(&format!("j-{i}"), 1, JobState::Running),
            2,
            &mut fx,
        );
    }
    c.set_node_admin("a2", NodeAdmin::Ready, 3, &mut fx)
        .unwrap();
    let mut sent = Vec::new();
    for t in [1000, 2000, 3000, 4000] {
        c.load_report("a2", NodeLoad::default(), t, &mut Effects::default());
        let mut fx = Effects::default();
        c.tick(t, &mut fx);
        sent.extend(assigns(&fx));
    }
    assert_eq!(c.node("a1").unwrap().state(), NodeState::Down);
    assert!(sent.iter().all(|(n, _)| n == "a2"), "{sent:?}");
    for id in ["j-2", "j-4"] {
        let j = c.get_job(id).unwrap();
        assert_eq!(
            (state_of(&c, id), j.node.as_str(), j.attempt),
            (JobState::Assigned, "a2", 2),
            "{j:?}"
        );
    }
    for id in ["j-1", "j-3"] {
        assert_eq!(state_of(&c, id), JobState::Lost);
    }
}

/// A node marked DOWN for missed heartbeats whose stream stayed open comes
/// back when it reports again, and takes jobs again.
#[test]
fn a_stalled_node_comes_back_when_it_reports_again() {
    let mut c = Cluster::new(ClusterConfig::default());
    register(&mut c, "a", "1s:2c:1t", "z1", "r1", 0);
    let mut fx = Effects::default();
    c.tick(10_000, &mut fx);
    assert_eq!(c.node("a").unwrap().state(), NodeState::Down);
    c.submit(vec![job(1)], false, 10_001, &mut fx).unwrap();
    assert_eq!(state_of(&c, "j-1"), JobState::Pending);
    let mut fx = Effects::default();
    c.load_report("a", NodeLoad::default(), 10_002, &mut fx);
    assert_eq!(c.node("a").unwrap().state(), NodeState::Ready);
    assert_eq!(assigns(&fx), vec![("a".to_string(), "j-1".to_string())]);
}

/// The (node, job, attempt) of every Cancel in `fx`.
pub(crate) fn cancels(fx: &Effects) -> Vec<(String, String, u32)> {
    fx.to_agents
        .iter()
        .filter_map(|(n, m)| match &m.message().msg {
            Some(dispatcher_message::Msg::Cancel(x)) => {
                Some((n.to_string(), x.job_id.clone(), x.attempt))
            }
            _ => None,
        })
        .collect()
}

/// j-1 (one retry) runs on `a`; `a` misses its heartbeats (the other
/// nodes report) and j-1 is retried: attempt 2.
fn retried_after_its_node_was_lost(c: &mut Cluster, others: &[&str]) -> Effects {
    let mut fx = Effects::default();
    let mut spec = job(1);
    spec.retries = 1;
    c.submit(vec![spec], false, 1, &mut fx).unwrap();
    assert_eq!(node_of(c, "j-1"), "a");
    c.job_status("a", status("j-1", 1, JobState::Running), 2, &mut fx);
    for n in others {
        c.load_report(n, NodeLoad::default(), 9_500, &mut fx);
    }
    let mut fx = Effects::default();
    c.tick(10_000, &mut fx);
    assert_eq!(c.node("a").unwrap().state(), NodeState::Down);
    assert_eq!(c.get_job("j-1").unwrap().attempt, 2);
    fx
}

/// Attempt 1 ended (SUCCEEDED, or FAILED with its exit code) on `a`
/// while `a` was cut off, and `a` reports it when it registers again,
/// before the retry started: the job takes that result, the retry never
/// runs (no Assign), and its record says why.
#[test]
fn a_retried_attempt_that_had_ended_ends_the_job_when_its_node_returns() {
    for (state, exit_code, said) in [
        (JobState::Succeeded, 0, "attempt 1 succeeded on a"),
        (JobState::Failed, 3, "attempt 1 failed on a"),
    ] {
        let mut c = Cluster::new(ClusterConfig::default());
        register(&mut c, "a", "1s:2c:1t", "z1", "r1", 0);
        retried_after_its_node_was_lost(&mut c, &[]);
        assert_eq!(state_of(&c, "j-1"), JobState::Pending);
        let mut fx = Effects::default();
        let mut done = status("j-1", 1, state);
        done.cpus = vec![1];
        done.time_ms = 5;
        done.exit_code = exit_code;
        register_node_with_jobs(
            &mut c,
            "a",
            "1s:2c:1t",
            ("z1", "r1"),
            vec![done],
            11_000,
            &mut fx,
        );
        c.settle(11_000, &mut fx);
        let j = c.get_job("j-1").unwrap();
        assert_eq!(state_of(&c, "j-1"), state, "{j:?}");
        assert!(
            assigns(&fx).is_empty(),
            "the retry was sent: {:?}",
            fx.to_agents
        );
        assert_eq!(
            (j.cpus.as_slice(), j.start_time_ms, j.exit_code),
            (&[1][..], 5, exit_code)
        );
        assert!(
            j.reason
                .starts_with(&format!("{said}, reported when the node came back")),
            "{}",
            j.reason
        );
        assert!(matches!(
            c.phase("j-1"),
            Some(Phase::Done { end: End::StaleAttemptEnded { attempt: 1, node, state: s }, .. })
                if node == "a" && *s == state
        ));
        // Its CPUs are free: a new job starts on a.
        let mut fx = Effects::default();
        c.submit(vec![job(2)], false, 11_001, &mut fx).unwrap();
        assert_eq!(assigns(&fx), vec![("a".to_string(), "j-2".to_string())]);
        c.check().unwrap();
    }
}

/// The retry was already sent to a peer (started there or not) when the
/// stale attempt's success arrives on the lost node's stream (it stalled
/// with the stream open): the retry stands, since the peer may start it
/// before any Cancel reaches it, and a job shown SUCCEEDED must not start
/// after (the model test's promise). The report is stale, as before.
#[test]
fn a_stale_success_leaves_a_retry_already_sent() {
    for started in [false, true] {
        let mut c = Cluster::new(ClusterConfig::default());
        register(&mut c, "a", "1s:2c:1t", "z1", "r1", 0);
        register(&mut c, "b", "1s:2c:1t", "z1", "r1", 0);
        // b is cordoned while j-1 is placed, so that it goes to a.
        let mut fx = Effects::default();
        c.set_node_admin("b", NodeAdmin::Cordoned, 0, &mut fx)
            .unwrap();
        let mut fx = Effects::default();
        let mut spec = job(1);
        spec.retries = 1;
        c.submit(vec![spec], false, 1, &mut fx).unwrap();
        c.job_status("a", status("j-1", 1, JobState::Running), 2, &mut fx);
        c.set_node_admin("b", NodeAdmin::Ready, 3, &mut fx).unwrap();
        c.load_report("b", NodeLoad::default(), 9_500, &mut fx);
        let mut fx = Effects::default();
        c.tick(10_000, &mut fx);
        assert_eq!(c.node("a").unwrap().state(), NodeState::Down);
        assert_eq!(assigns(&fx), vec![("b".to_string(), "j-1".to_string())]);
        let state = if started {
            c.job_status("b", status("j-1", 2, JobState::Running), 10_001, &mut fx);
            JobState::Running
        } else {
            JobState::Assigned
        };
        let mut fx = Effects::default();
        c.job_status("a", status("j-1", 1, JobState::Succeeded), 10_002, &mut fx);
        let j = c.get_job("j-1").unwrap();
        assert_eq!(
            (state_of(&c, "j-1"), j.attempt, j.node.as_str()),
            (state, 2, "b")
        );
        assert!(cancels(&fx).is_empty(), "{:?}", fx.to_agents);
        c.check().unwrap();
    }
}

/// Only an end of the very attempt lost with that node counts: the same
/// report from another node, or the stale attempt still RUNNING (it is
/// cancelled there), leaves the unsent retry alone.
#[test]
fn only_an_end_of_the_lost_attempt_from_its_node_is_adopted() {
    for (from, state) in [
        ("b", JobState::Succeeded),
        ("b", JobState::Failed),
        ("a", JobState::Running),
    ] {
        let mut c = Cluster::new(ClusterConfig::default());
        register(&mut c, "a", "1s:2c:1t", "z1", "r1", 0);
        register(&mut c, "b", "1s:2c:1t", "z1", "r1", 0);
        // b is cordoned: j-1 goes to a, and its retry waits unsent.
        let mut fx = Effects::default();
        c.set_node_admin("b", NodeAdmin::Cordoned, 0, &mut fx)
            .unwrap();
        retried_after_its_node_was_lost(&mut c, &["b"]);
        assert_eq!(state_of(&c, "j-1"), JobState::Pending);
        let mut fx = Effects::default();
        c.job_status(from, status("j-1", 1, state), 10_002, &mut fx);
        let j = c.get_job("j-1").unwrap();
        assert_eq!(
            (state_of(&c, "j-1"), j.attempt),
            (JobState::Pending, 2),
            "{from} {state:?}"
        );
        c.check().unwrap();
    }
}

/// A job an oversubscribed agent holds unstarted is asked back when a
/// rack peer has room, and placed there once the agent releases it.
#[test]
fn agent_held_jobs_are_stolen_by_idle_rack_peers() {
    let mut c = Cluster::new(ClusterConfig::default());
    let mut fx = Effects::default();
    let mut labels = HashMap::new();
    labels.insert("topology.kubernetes.io/zone".to_string(), "z1".to_string());
    labels.insert("dispatch.io/rack".to_string(), "r1".to_string());
    c.register(
        Register {
            node: "a".into(),
            labels: labels.clone(),
            topology: Some(machine("1s:2c:1t")),
            oversubscribe: 2,
            ..Default::default()
        },
        0,
        &mut fx,
    )
    .unwrap();
    register(&mut c, "b", "1s:2c:1t", "z1", "r1", 0);
    c.set_node_admin("b", NodeAdmin::Cordoned, 0, &mut fx)
        .unwrap();
    let mut fx = Effects::default();
    c.submit(vec![job(1), job(1), job(1)], true, 1, &mut fx)
        .unwrap();
    assert_eq!(assigns(&fx).len(), 3, "a takes 2 CPUs x 2 slots");
    c.job_status("a", status("j-1", 1, JobState::Running), 2, &mut fx);
    c.job_status("a", status("j-2", 1, JobState::Running), 2, &mut fx);
    c.set_node_admin("b", NodeAdmin::Ready, 3, &mut fx).unwrap();
    for t in [500, 1000, 1500] {
        c.load_report("a", NodeLoad::default(), t, &mut fx);
        c.load_report("b", NodeLoad::default(), t, &mut fx);
    }
    let mut fx = Effects::default();
    c.tick(1500, &mut fx);
    let steals: Vec<_> = fx
        .to_agents
        .iter()
        .filter_map(|(n, m)| match &m.message().msg {
            Some(dispatcher_message::Msg::Steal(s)) => Some((n.to_string(), s.job_id.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(steals, vec![("a".to_string(), "j-3".to_string())]);
    let mut fx = Effects::default();
    c.steal_reply(
        "a",
        proto::v1::StealReply {
            job_id: "j-3".into(),
            attempt: 1,
            released: true,
        },
        1600,
        &mut fx,
    );
    assert_eq!(assigns(&fx), vec![("b".to_string(), "j-3".to_string())]);
    assert!(c.get_job("j-3").unwrap().reason.contains("gave it back"));
}

#[test]
fn owners_are_recorded_sent_with_assignments_and_filter_lists() {
    let mut c = Cluster::new(ClusterConfig::default());
    register(&mut c, "n1", "1s:4c:1t", "z1", "r1", 0);
    let mut fx = Effects::default();
    let alice = c
        .submit_as("alice", vec![job(1)], false, 1, &mut fx)
        .unwrap();
    let bob = c.submit_as("bob", vec![job(1)], false, 2, &mut fx).unwrap();
    assert_eq!(&*alice[0].owner, "alice");
    assert_eq!(c.get_job(&bob[0].id()).unwrap().owner, "bob");
    // The agent learns each job's owner with its assignment.
    let owners: Vec<(String, String)> = fx
        .to_agents
        .iter()
        .filter_map(|(_, m)| match &m.message().msg {
            Some(dispatcher_message::Msg::Assign(a)) => Some((a.job_id.clone(), a.owner.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(
        owners,
        vec![
            (alice[0].id(), "alice".to_string()),
            (bob[0].id(), "bob".to_string())
        ]
    );
    let (page, _) = c
        .list_jobs(&ListJobsRequest {
            owner: "bob".into(),
            ..Default::default()
        })
        .unwrap();
    assert_eq!(
        page.iter().map(|j| j.id.clone()).collect::<Vec<_>>(),
        vec![bob[0].id()]
    );
    let (all, _) = c.list_jobs(&ListJobsRequest::default()).unwrap();
    assert_eq!(all.len(), 2);
    // Without an owner (no tokens) the field stays empty.
    let anon = c.submit(vec![job(1)], false, 3, &mut fx).unwrap();
    assert_eq!(&*anon[0].owner, "");
}

/// A cancel request is stored with the job: after a dispatcher restart,
/// the node's loss ends the job CANCELLED instead of retrying it.
#[test]
fn a_cancel_survives_a_dispatcher_restart() {
    let mut c = Cluster::new(ClusterConfig::default());
    register(&mut c, "a", "1s:2c:1t", "z1", "r1", 0);
    let mut fx = Effects::default();
    let spec = JobSpec {
        retries: 1,
        ..job(1)
    };
    c.submit(vec![spec], false, 1, &mut fx).unwrap();
    let mut fx = Effects::default();
    c.cancel("j-1", 2, &mut fx).unwrap();
    assert_eq!(
        state_of(&c, "j-1"),
        JobState::Assigned,
        "waits for its node"
    );
    c.write_back(&mut fx);
    let stored: Vec<Job> = fx
        .writes
        .iter()
        .filter_map(|w| match w {
            Write::PutJob(j) => Some(j.to_proto()),
            _ => None,
        })
        .collect();
    assert!(stored.iter().any(|j| j.id == "j-1" && j.cancel_requested));
    let snap = Snapshot {
        jobs: c.jobs_matching(&[]),
        node_admin: HashMap::new(),
        next_job: 2,
    };
    let mut d = Cluster::new(ClusterConfig::default());
    d.restore(snap, 100, 5_000);
    let mut fx = Effects::default();
    d.tick(6_000, &mut fx);
    assert_eq!(state_of(&d, "j-1"), JobState::Cancelled);
    assert!(assigns(&fx).is_empty());
}

/// Every node a tick finds overdue is DOWN before any job is retried: a
/// retry never goes to a node lost in the same tick.
#[test]
fn retries_never_go_to_a_node_lost_in_the_same_tick() {
    let mut c = Cluster::new(ClusterConfig::default());
    for n in ["a", "b", "c"] {
        register(&mut c, n, "1s:2c:1t", "z1", "r1", 0);
    }
    let mut fx = Effects::default();
    let spec = JobSpec {
        retries: 1,
        ..job(1)
    };
    c.submit(vec![spec], false, 1, &mut fx).unwrap();
    let first = c.get_job("j-1").unwrap().node;
    // Only the last of the other two keeps reporting.
    let alive = if first == "c" { "b" } else { "c" };
    for t in [1000, 2000, 3000, 4000] {
        c.load_report(alive, NodeLoad::default(), t, &mut Effects::default());
    }
    let mut fx = Effects::default();
    c.tick(4000, &mut fx);
    assert_eq!(assigns(&fx), vec![(alive.to_string(), "j-1".to_string())]);
    assert_eq!(c.get_job("j-1").unwrap().attempt, 2);
}

/// A job placed on a node that the same batch's tick then finds overdue
/// is taken back within the batch: its Assign is not sent (the core's
/// `seal` drops it), only the Cancel of the attempt and the retry's
/// Assign elsewhere. Without the drop the stalled node would be told to
/// start the attempt the batch commits as lost.
#[test]
fn an_attempt_taken_back_in_its_batch_is_not_sent() {
    let mut c = Cluster::new(ClusterConfig::default());
    register(&mut c, "a", "1s:2c:1t", "z1", "r1", 0);
    register(&mut c, "b", "1s:2c:1t", "z1", "r1", 0);
    let mut fx = Effects::default();
    c.submit(vec![job(2)], false, 1, &mut fx).unwrap();
    let busy = c.get_job("j-1").unwrap().node;
    let stalled = if busy == "a" { "b" } else { "a" };
    // Only the busy node keeps reporting; the other stalls at 0.
    for t in [1000, 2000, 3000] {
        c.load_report(&busy, NodeLoad::default(), t, &mut Effects::default());
    }
    // One batch at 3500: a retried job and one that may not be retried
    // go to the stalled node (the only one with room), then the tick
    // finds it overdue and takes both back (the retry waits: no room).
    let mut fx = Effects::default();
    let retried = JobSpec {
        retries: 1,
        ..job(1)
    };
    c.submit(vec![retried, job(1)], false, 3500, &mut fx)
        .unwrap();
    assert_eq!(c.get_job("j-2").unwrap().node, stalled);
    assert_eq!(c.get_job("j-3").unwrap().node, stalled);
    c.load_report(&busy, NodeLoad::default(), 3500, &mut fx);
    c.tick(3500, &mut fx);
    assert_eq!(state_of(&c, "j-3"), JobState::Lost);
    assert_eq!(c.get_job("j-2").unwrap().attempt, 2);
    let before = assigns(&fx);
    assert!(before.contains(&(stalled.to_string(), "j-3".to_string())));
    c.drop_taken_back_assigns(&mut fx);
    let sent: Vec<(String, String)> = assigns(&fx);
    assert!(
        sent.iter().all(|(node, _)| node != stalled),
        "assigns to the lost node were sent: {sent:?}"
    );
    let cancelled: Vec<String> = fx
        .to_agents
        .iter()
        .filter(|(n, _)| n.as_str() == stalled)
        .filter_map(|(_, m)| match m.message().msg {
            Some(dispatcher_message::Msg::Cancel(c)) => Some(c.job_id),
            _ => None,
        })
        .collect();
    assert_eq!(cancelled, vec!["j-2".to_string(), "j-3".to_string()]);
}

/// A job cancelled while its agent held it unstarted, then given back,
/// ends CANCELLED and is never placed again.
#[test]
fn a_cancelled_job_given_back_by_a_steal_is_not_placed_again() {
    let mut c = Cluster::new(ClusterConfig::default());
    register(&mut c, "a", "1s:2c:1t", "z1", "r1", 0);
    let mut fx = Effects::default();
    c.submit(vec![job(1)], false, 1, &mut fx).unwrap();
    c.cancel("j-1", 2, &mut fx).unwrap();
    let mut fx = Effects::default();
    c.steal_reply(
        "a",
        proto::v1::StealReply {
            job_id: "j-1".into(),
            attempt: 1,
            released: true,
        },
        3,
        &mut fx,
    );
    assert_eq!(state_of(&c, "j-1"), JobState::Cancelled);
    assert!(assigns(&fx).is_empty());
}

/// A job retried (or lost) because its node missed its heartbeats is also
/// cancelled on that node: a node that only stalled, with its stream still
/// open, stops the old copy as soon as it reads its stream again, instead
/// of running it beside the retry until it next reports the job.
#[test]
fn a_lost_attempt_is_cancelled_on_its_stalled_node() {
    let mut c = Cluster::new(ClusterConfig::default());
    register(&mut c, "a", "1s:2c:1t", "z1", "r1", 0);
    let mut fx = Effects::default();
    let mut retried = job(2);
    retried.retries = 1;
    c.submit(vec![retried, job(1)], true, 1, &mut fx).unwrap();
    c.job_status("a", status("j-1", 1, JobState::Running), 2, &mut fx);
    register(&mut c, "b", "1s:2c:1t", "z1", "r1", 2);
    let mut lost_fx = Effects::default();
    for t in [1000, 2000, 3000, 4000] {
        c.load_report("b", NodeLoad::default(), t, &mut Effects::default());
        c.tick(t, &mut lost_fx);
    }
    // j-1 (retries 1) goes to b as attempt 2; attempt 1 is cancelled on a.
    let j1 = c.get_job("j-1").unwrap();
    assert_eq!((j1.attempt, j1.node.as_str()), (2, "b"), "{j1:?}");
    let sent = cancels(&lost_fx);
    assert!(
        sent.contains(&("a".to_string(), "j-1".to_string(), 1)),
        "{sent:?}"
    );
    // Nothing is cancelled on the node that runs the retry.
    assert!(sent.iter().all(|(n, _, _)| n == "a"), "{sent:?}");
    // When a reports the old attempt afterwards, it is cancelled again and
    // the retry on b is untouched.
    let mut fx = Effects::default();
    c.job_status("a", status("j-1", 1, JobState::Running), 4001, &mut fx);
    assert_eq!(cancels(&fx), vec![("a".to_string(), "j-1".to_string(), 1)]);
    let j1 = c.get_job("j-1").unwrap();
    assert_eq!((j1.attempt, j1.node.as_str()), (2, "b"), "{j1:?}");
}

/// One field answers "where is job X and why": the phase, through a
/// queue, a start, a node loss with a retry, and the end; the reason shown
/// to users is generated from it, and every placement is a `Move`.
#[test]
fn the_phase_says_where_a_job_is_and_why() {
    let mut c = Cluster::new(ClusterConfig::default());
    register(&mut c, "a", "1s:2c:1t", "z1", "r1", 0);
    let mut fx = Effects::default();
    let mut spec = job(2);
    spec.retries = 1;
    c.submit(vec![job(2), spec], true, 1, &mut fx).unwrap();
    assert!(matches!(
        c.phase("j-1"),
        Some(Phase::Assigned { node, since: 1, steal_asked: None, via: Via::Placed(_) }) if node == "a"
    ));
    assert!(matches!(
        c.phase("j-2"),
        Some(Phase::Queued { node, waiting: true, via: Via::Placed(_) }) if node == "a"
    ));
    let placed: Vec<(String, &str)> = fx
        .moves
        .iter()
        .map(|m| (m.job.to_string(), m.to.as_str()))
        .collect();
    assert_eq!(placed, vec![("j-1".to_string(), "a")]);
    c.job_status("a", status("j-1", 1, JobState::Succeeded), 2, &mut fx);
    // j-2 waited on a, and started there when j-1 ended.
    let Some(Phase::Assigned {
        via: Via::Waited(how),
        ..
    }) = c.phase("j-2").cloned()
    else {
        panic!("{:?}", c.phase("j-2"));
    };
    let reason = c.get_job("j-2").unwrap().reason;
    assert!(
        reason.starts_with("started on a when it had room; was queued on a (")
            && reason.contains(&jobs::placement_text(how)),
        "{reason}"
    );
    assert!(matches!(
        c.phase("j-1"),
        Some(Phase::Done { state: JobState::Succeeded, end: End::Reported(m) }) if m.is_empty()
    ));
    // a is lost: j-2 is retried; the only node takes no jobs, so it waits
    // in its queue.
    c.job_status("a", status("j-2", 1, JobState::Running), 3, &mut fx);
    assert!(matches!(c.phase("j-2"), Some(Phase::Running { node, .. }) if node == "a"));
    c.tick(10_000, &mut fx);
    let e = c.jobs.get(JobKey::parse("j-2").unwrap()).unwrap();
    assert_eq!(
        e.requeues,
        vec![Requeue::Retry {
            n: 1,
            of: 1,
            node: "a".into(),
            why: "missed heartbeats"
        }]
    );
    assert!(
        matches!(e.phase(), Phase::Queued { node, waiting: true, .. } if node == "a"),
        "{:?}",
        e.phase()
    );
    assert_eq!(e.job().attempt, 2);
    assert!(
        e.job()
            .reason
            .starts_with("retry 1 of 1: node a lost (missed heartbeats) | queued on a ("),
        "{}",
        e.job().reason
    );
    c.check().unwrap();
}

/// A plain job's `Assign` is its shared record, built into the proto only
/// when sent: it must say what the start sent, even once the job has
/// moved on (here: its node lost, attempt 2 on another node), and be the
/// message the start built before it was deferred.
#[test]
fn an_assign_sends_the_attempt_its_start_made() {
    let assign_of = |fx: &Effects| -> Vec<(String, proto::v1::Assign)> {
        fx.to_agents
            .iter()
            .filter_map(|(n, m)| match m.message().msg {
                Some(dispatcher_message::Msg::Assign(a)) => Some((n.to_string(), a)),
                _ => None,
            })
            .collect()
    };
    let mut c = Cluster::new(ClusterConfig::default());
    register(&mut c, "a", "1s:2c:1t", "z1", "r1", 0);
    let mut fx = Effects::default();
    let mut retried = job(2);
    retried.retries = 1;
    retried.env.insert("K".into(), "V".into());
    c.submit_as("alice", vec![retried.clone()], false, 1, &mut fx)
        .unwrap();
    assert!(
        matches!(fx.to_agents[..], [(_, ToAgent::Assign(_))]),
        "{:?}",
        fx.to_agents
    );
    let first = proto::v1::Assign {
        job_id: "j-1".into(),
        attempt: 1,
        spec: Some(retried.into()),
        owner: "alice".into(),
        ..Default::default()
    };
    assert_eq!(assign_of(&fx), vec![("a".to_string(), first.clone())]);
    c.job_status("a", status("j-1", 1, JobState::Running), 2, &mut fx);
    register(&mut c, "b", "1s:2c:1t", "z1", "r1", 2);
    let mut lost_fx = Effects::default();
    for t in [1000, 2000, 3000, 4000] {
        c.load_report("b", NodeLoad::default(), t, &mut Effects::default());
        c.tick(t, &mut lost_fx);
    }
    assert_eq!(c.get_job("j-1").unwrap().attempt, 2);
    // The first start's message is unchanged by the retry.
    assert_eq!(assign_of(&fx), vec![("a".to_string(), first.clone())]);
    let second = proto::v1::Assign {
        attempt: 2,
        ..first
    };
    assert_eq!(assign_of(&lost_fx), vec![("b".to_string(), second)]);
}

/// A reported end (`job_status`: one access of the record for the
/// report's facts and the end time, then `finish_ended`) leaves the job,
/// the effects and the next start exactly as the general path: the
/// report's facts set on their own, then `finish`, which sets the end
/// time. Both clusters run the same jobs; the second is driven through
/// the general path by hand.
#[test]
fn reported_end_is_finish_with_the_facts() {
    let setup = || {
        let mut c = Cluster::new(ClusterConfig::default());
        register(&mut c, "n1", "1s:2c:1t", "z1", "r1", 0);
        let mut fx = Effects::default();
        c.submit(vec![job(2), job(2)], true, 1, &mut fx).unwrap();
        c
    };
    let report = JobStatus {
        job_id: "j-1".into(),
        attempt: 1,
        state: JobState::Failed as i32,
        exit_code: 3,
        signal: 9,
        cpus: vec![0, 1],
        time_ms: 2,
        message: String::new(),
        ..Default::default()
    };
    let mut fast = setup();
    let mut fast_fx = Effects::default();
    fast.job_status("n1", report.clone(), 5, &mut fast_fx);
    let mut general = setup();
    let mut general_fx = Effects::default();
    let key = JobKey::parse("j-1").unwrap();
    if let Some(mut f) = general.jobs.facts(key) {
        f.set_exit(report.exit_code, report.signal);
        f.set_cpus(&report.cpus);
        f.set_start(report.time_ms);
    }
    general.finish(
        key,
        Phase::Done {
            state: JobState::Failed,
            end: End::Reported(String::new()),
        },
        5,
        &mut general_fx,
    );
    for id in ["j-1", "j-2"] {
        assert_eq!(
            fast.get_job(id).unwrap(),
            general.get_job(id).unwrap(),
            "{id}"
        );
    }
    let j1 = fast.get_job("j-1").unwrap();
    assert_eq!((j1.end_time_ms, j1.exit_code, j1.signal), (5, 3, 9));
    assert_eq!(assigns(&fast_fx), assigns(&general_fx));
    assert_eq!(
        assigns(&fast_fx),
        vec![("n1".to_string(), "j-2".to_string())]
    );
    let events = |fx: &Effects| -> Vec<_> {
        fx.events
            .iter()
            .map(|e| (e.job.to_proto(), e.previous_state, e.time_ms))
            .collect()
    };
    assert_eq!(events(&fast_fx), events(&general_fx));
    // A report for the ended job changes nothing (`finish`'s own check).
    let before = fast.get_job("j-1").unwrap();
    let mut fx = Effects::default();
    fast.job_status("n1", report, 9, &mut fx);
    assert_eq!(fast.get_job("j-1").unwrap(), before);
}

/// The engine's host-group level (`NodeEngine::rebuild`): nodes sharing a
/// host group label in one rack are one group, and a node without the
/// label is a group of its own, whatever its name.
#[test]
fn nodes_of_a_host_group_share_its_domain_and_unlabelled_ones_stand_alone() {
    let mut c = Cluster::new(ClusterConfig::default());
    let mut fx = Effects::default();
    for (name, hostgroup) in [("a", "g1"), ("b", "g1"), ("c", ""), ("d", "g2"), ("e", "")] {
        let mut labels = HashMap::new();
        labels.insert("topology.kubernetes.io/zone".to_string(), "z1".to_string());
        labels.insert("dispatch.io/rack".to_string(), "r1".to_string());
        if !hostgroup.is_empty() {
            labels.insert("dispatch.io/hostgroup".to_string(), hostgroup.to_string());
        }
        c.register(
            Register {
                node: name.into(),
                labels,
                topology: Some(machine("1s:2c:1t")),
                ..Default::default()
            },
            0,
            &mut fx,
        )
        .unwrap();
    }
    c.settle(0, &mut fx);
    let leaf = |n: &str| c.engine.leaf(n).unwrap();
    let topo = c.engine.sched().unwrap().topology().clone();
    let group = |n: &str| {
        let mut g: Vec<LeafId> = topo.smt_siblings(leaf(n)).to_vec();
        g.sort_unstable();
        g
    };
    let mut ab = vec![leaf("a"), leaf("b")];
    ab.sort_unstable();
    assert_eq!(group("a"), ab);
    assert_eq!(group("b"), ab);
    for alone in ["c", "d", "e"] {
        assert_eq!(group(alone), vec![leaf(alone)], "{alone}");
    }
}

mod submit_each {
    use proptest::prelude::*;

    use super::*;

    /// A cluster of three 4-CPU nodes in two racks.
    fn small() -> Cluster {
        let mut c = Cluster::new(ClusterConfig::default());
        for (name, rack) in [("n1", "r1"), ("n2", "r1"), ("n3", "r2")] {
            node_in_rack(&mut c, name, "1s:4c:1t", rack);
        }
        c
    }

    /// A submission of the strategy: one spec per (cpus, array count);
    /// `valid` false empties the first spec's command.
    fn specs(jobs: &[(u32, u32)], valid: bool) -> Vec<JobSpec> {
        let mut specs: Vec<JobSpec> = jobs
            .iter()
            .map(|&(cpus, count)| JobSpec {
                command: vec!["true".into()],
                cpus,
                array_count: count,
                ..Default::default()
            })
            .collect();
        if !valid {
            specs[0].command.clear();
        }
        specs
    }

    proptest! {
        /// `submit_each` (the core's run of submissions) against its
        /// oracle: each bad submission gets the error it gets alone on
        /// an empty cluster and creates nothing; the good ones' jobs are
        /// created, numbered and placed exactly as one submission of all
        /// their specs in order (same ids, states and nodes).
        #[test]
        fn submit_each_is_one_submission_of_the_good_ones(
            subs in prop::collection::vec(
                (prop::collection::vec((1u32..=4, 0u32..3), 1..4), prop::bool::weighted(0.8), any::<bool>()),
                1..8,
            ),
            busy in 0usize..12,
        ) {
            let (mut each, mut one) = (small(), small());
            // Some jobs already running, the same in both.
            for c in [&mut each, &mut one] {
                let mut fx = Effects::default();
                let running: Vec<JobSpec> = (0..busy).map(|i| JobSpec { cpus: 1 + (i % 2) as u32, ..specs(&[(1, 0)], true)[0].clone() }).collect();
                if !running.is_empty() {
                    c.submit(running, true, 1, &mut fx).unwrap();
                }
            }
            let mut fx = Effects::default();
            let results = each.submit_each(
                subs.iter().map(|(jobs, valid, batch)| ("u", specs(jobs, *valid), *batch)),
                2,
                &mut fx,
            );
            prop_assert_eq!(results.len(), subs.len());
            let good: Vec<JobSpec> = subs
                .iter()
                .filter(|(_, valid, _)| *valid)
                .flat_map(|(jobs, _, _)| specs(jobs, true))
                .collect();
            let mut fx = Effects::default();
            let expected = if good.is_empty() {
                Vec::new()
            } else {
                one.submit_as("u", good, true, 2, &mut fx).unwrap()
            };
            let mut created = Vec::new();
            for ((jobs, valid, batch), r) in subs.iter().zip(results) {
                if *valid {
                    created.extend(r.unwrap().iter().map(|j| j.id()));
                } else {
                    let alone = small()
                        .submit_as("u", specs(jobs, false), *batch, 2, &mut Effects::default())
                        .unwrap_err();
                    let got = r.unwrap_err();
                    prop_assert_eq!(got.code(), alone.code());
                    prop_assert_eq!(got.message(), alone.message());
                }
            }
            let expected: Vec<String> = expected.iter().map(|j| j.id()).collect();
            prop_assert_eq!(&created, &expected);
            for id in &created {
                let (a, b) = (each.get_job(id).unwrap(), one.get_job(id).unwrap());
                prop_assert_eq!((a.state, &a.node), (b.state, &b.node), "job {}", id);
            }
        }
    }
}

/// The engine keeps each leaf's shape as an entry of the distinct shapes:
/// every leaf, in leaf order, reads its node's own shape
/// (`NodeInfo::shape`: largest aligned room, memory, GPUs), nodes of one
/// machine and memory sharing an entry, other machines or memories not.
#[test]
fn each_leaf_reads_its_nodes_shape() {
    let mut c = Cluster::new(ClusterConfig::default());
    let specs = ["2s:4c:2t", "1s:8c:1t", "2s:4c:2t", "1s:2c:1t", "1s:8c:2t"];
    let mut fx = Effects::default();
    for i in 0..15u64 {
        let mut labels = HashMap::new();
        labels.insert("dispatch.io/rack".to_string(), format!("r{}", i % 3));
        c.register(
            Register {
                node: format!("n{i}"),
                labels,
                topology: Some(machine(specs[i as usize % specs.len()])),
                memory_bytes: (i % 2) << 30,
                ..Default::default()
            },
            0,
            &mut fx,
        )
        .unwrap();
    }
    c.settle(0, &mut fx);
    let order: Vec<String> = c
        .engine
        .order()
        .iter()
        .map(|n| n.as_str().to_string())
        .collect();
    let shapes: Vec<(String, (sched::FreeSummary, u64, u32))> = c
        .engine
        .shapes()
        .map(|(name, &shape)| (name.to_string(), shape))
        .collect();
    assert_eq!(shapes.len(), 15);
    assert_eq!(
        shapes.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>(),
        order
    );
    for (name, shape) in &shapes {
        assert_eq!(*shape, c.nodes.get(name).unwrap().shape(), "{name}");
    }
    let mut distinct: Vec<_> = shapes.iter().map(|(_, s)| *s).collect();
    distinct.sort_by_key(|s| (s.0.any, s.0.core, s.0.llc, s.1));
    distinct.dedup();
    assert!(distinct.len() > 1);
}

mod status_batches {
    use proptest::prelude::*;

    use super::*;

    /// A cluster of three 4-CPU nodes in two racks, `jobs` submitted (one
    /// spec each, of that many CPUs: some run, the rest queue).
    fn loaded(jobs: &[u32]) -> Cluster {
        let mut c = Cluster::new(ClusterConfig::default());
        for (name, rack) in [("n1", "r1"), ("n2", "r1"), ("n3", "r2")] {
            node_in_rack(&mut c, name, "1s:4c:1t", rack);
        }
        let mut fx = Effects::default();
        c.submit(jobs.iter().map(|&n| job(n)).collect(), false, 1, &mut fx)
            .unwrap();
        c
    }

    /// What a test compares of a cluster: every job's state, node and
    /// attempt.
    fn jobs_of(c: &Cluster, n: usize) -> Vec<(i32, String, u32)> {
        (1..=n)
            .map(|i| {
                let j = c.get_job(&format!("j-{i}")).unwrap();
                (j.state, j.node, j.attempt)
            })
            .collect()
    }

    /// The engine's aggregates at its root (read by `&self`: they must
    /// have been refreshed, which a debug assertion checks).
    fn root_aggregates(c: &Cluster) -> Option<sched::sched::NodeAgg> {
        c.engine.sched().map(|s| s.aggregate(s.topology().root()))
    }

    proptest! {
        /// `job_statuses` (an agent's StatusBatch, the node aggregates'
        /// refresh deferred over the batch) against its oracle, the same
        /// statuses applied one by one with `job_status`: the same jobs
        /// end, the same queued jobs start on the same nodes in the same
        /// order, and a submission after it is placed the same.
        #[test]
        fn a_status_batch_is_its_statuses_one_by_one(
            jobs in prop::collection::vec(1u32..=4, 1..16),
            picks in prop::collection::vec((0usize..16, 0u8..4, any::<bool>()), 0..24),
            after in prop::collection::vec(1u32..=4, 1..4),
        ) {
            let (mut batched, mut each) = (loaded(&jobs), loaded(&jobs));
            // The node whose agent reports: the one the most jobs hold.
            let node = ["n1", "n2", "n3"]
                .into_iter()
                .max_by_key(|n| jobs_of(&each, jobs.len()).iter().filter(|j| j.1 == *n).count())
                .unwrap();
            let statuses: Vec<JobStatus> = picks
                .iter()
                .map(|&(i, s, stale)| {
                    let state = [
                        JobState::Running,
                        JobState::Succeeded,
                        JobState::Failed,
                        JobState::Succeeded,
                    ][s as usize];
                    let id = format!("j-{}", 1 + i % jobs.len());
                    status(&id, if stale { 2 } else { 1 }, state)
                })
                .collect();
            let (mut fx_b, mut fx_e) = (Effects::default(), Effects::default());
            batched.job_statuses(node, statuses.clone(), 5, &mut fx_b);
            for s in statuses {
                each.job_status(node, s, 5, &mut fx_e);
            }
            prop_assert_eq!(jobs_of(&batched, jobs.len()), jobs_of(&each, jobs.len()));
            prop_assert_eq!(assigns(&fx_b), assigns(&fx_e));
            batched.write_back(&mut fx_b);
            each.write_back(&mut fx_e);
            prop_assert_eq!(fx_b.writes.len(), fx_e.writes.len());
            // The batch's end refreshed what it deferred.
            prop_assert_eq!(root_aggregates(&batched), root_aggregates(&each));
            let (mut fx_b, mut fx_e) = (Effects::default(), Effects::default());
            let specs: Vec<JobSpec> = after.iter().map(|&n| job(n)).collect();
            batched.submit(specs.clone(), false, 6, &mut fx_b).unwrap();
            each.submit(specs, false, 6, &mut fx_e).unwrap();
            let n = jobs.len() + after.len();
            prop_assert_eq!(jobs_of(&batched, n), jobs_of(&each, n));
            prop_assert_eq!(assigns(&fx_b), assigns(&fx_e));
        }
    }
}
