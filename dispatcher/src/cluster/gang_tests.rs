//! Gangs as the dispatcher drives them (register, submit, statuses,
//! ticks): all or nothing, the reservation and its backfill, the
//! preferred level relaxing, member loss under both retry policies, a
//! member's failure ending the gang, a restart; and a property test that
//! no partial gang ever holds CPUs, against a brute-force check of the
//! job table.

use std::collections::HashMap;

use proptest::prelude::*;
use proto::v1::{
    GangRetry, JobSpec, JobState, JobStatus, NodeLoad, PendingReasonKind, Within,
    dispatcher_message,
};

use super::tests::{assigns, cancels, job_with_limit as single, register_node};
use super::*;
use crate::store::Snapshot;

fn cluster() -> Cluster {
    Cluster::new(ClusterConfig::default())
}

fn node(c: &mut Cluster, name: &str, rack: &str, now: i64) {
    let mut fx = Effects::default();
    register_node(c, name, "1s:4c:1t", ("z1", rack), now, &mut fx);
    c.settle(now, &mut fx);
}

fn gang(nodes: u32, within: Within, cpus: u32) -> JobSpec {
    JobSpec {
        nodes,
        within: within as i32,
        ..single(cpus, 0)
    }
}

fn submit(c: &mut Cluster, spec: JobSpec, now: i64) -> (Vec<String>, Effects) {
    let mut fx = Effects::default();
    let jobs = c.submit(vec![spec], false, now, &mut fx).unwrap();
    c.check().unwrap();
    (jobs.into_iter().map(|j| j.id()).collect(), fx)
}

fn report(
    c: &mut Cluster,
    node: &str,
    id: &str,
    attempt: u32,
    state: JobState,
    now: i64,
) -> Effects {
    let mut fx = Effects::default();
    let status = JobStatus {
        job_id: id.into(),
        attempt,
        state: state as i32,
        ..Default::default()
    };
    c.job_status(node, status, now, &mut fx);
    c.check().unwrap();
    fx
}

fn state(c: &Cluster, id: &str) -> JobState {
    JobState::try_from(c.get_job(id).unwrap().state).unwrap()
}

fn node_of(c: &Cluster, id: &str) -> String {
    c.get_job(id).unwrap().node
}

fn rack_of(c: &Cluster, id: &str) -> String {
    c.node(&node_of(c, id)).unwrap().rack().to_string()
}

fn kind(c: &Cluster, id: &str, now: i64) -> PendingReasonKind {
    let r = c.pending_reason(id, now).expect("waits");
    PendingReasonKind::try_from(r.kind).unwrap()
}

/// CPUs the dispatcher's model marks busy, over all nodes.
fn busy_cpus(c: &Cluster) -> usize {
    c.nodes().map(|n| n.busy_cpus() as usize).sum()
}

/// Rack r1 has 3 nodes, r2 has 2: a gang of 4 within one rack never fits
/// and holds nothing while it waits; a gang of 3 starts on r1's three
/// nodes in one operation (three assignments in one `Effects`).
#[test]
fn all_or_nothing_with_a_rack_too_small() {
    let mut c = cluster();
    for (n, r) in [
        ("a1", "r1"),
        ("a2", "r1"),
        ("a3", "r1"),
        ("b1", "r2"),
        ("b2", "r2"),
    ] {
        node(&mut c, n, r, 0);
    }
    let (ids, fx) = submit(&mut c, gang(4, Within::Rack, 2), 1);
    assert_eq!(ids, ["j-1.0", "j-1.1", "j-1.2", "j-1.3"]);
    assert!(assigns(&fx).is_empty(), "{:?}", assigns(&fx));
    for id in &ids {
        assert_eq!(state(&c, id), JobState::Pending);
        assert_eq!(c.get_job(id).unwrap().gang_id, "j-1");
        assert_eq!(kind(&c, id, 1), PendingReasonKind::GangResources);
    }
    assert_eq!(busy_cpus(&c), 0, "a waiting gang holds no CPU");
    let err = c.get_job("j-1").unwrap_err();
    assert!(err.message().contains("is a gang of 4"), "{err}");

    let (ids, fx) = submit(&mut c, gang(3, Within::Rack, 2), 2);
    let sent = assigns(&fx);
    assert_eq!(sent.len(), 3, "all members in one operation: {sent:?}");
    // Each member's Assign tells it its gang, index and peers.
    let nodes: Vec<String> = ids.iter().map(|id| node_of(&c, id)).collect();
    for (_, m) in &fx.to_agents {
        if let Some(dispatcher_message::Msg::Assign(a)) = &m.message().msg {
            let env = &a.spec.as_ref().unwrap().env;
            let index = a.job_id.rsplit('.').next().unwrap();
            assert_eq!(env["DISPATCH_GANG_ID"], "j-2");
            assert_eq!(env["DISPATCH_GANG_INDEX"], index);
            assert_eq!(env["DISPATCH_GANG_SIZE"], "3");
            assert_eq!(env["DISPATCH_GANG_NODES"], nodes.join(","));
        }
    }
    // The stored spec stays the user's.
    assert!(c.get_job(&ids[0]).unwrap().spec.unwrap().env.is_empty());
    for id in &ids {
        assert_eq!(state(&c, id), JobState::Assigned);
        assert_eq!(rack_of(&c, id), "r1");
        assert!(
            c.get_job(id)
                .unwrap()
                .reason
                .starts_with("gang j-2: member")
        );
    }
    assert_eq!(busy_cpus(&c), 6);
    // The first gang still waits, holding nothing more.
    assert_eq!(state(&c, "j-1.0"), JobState::Pending);
    // Cancelling the gang's id cancels every member.
    let mut fx = Effects::default();
    c.cancel("j-1", 3, &mut fx).unwrap();
    assert_eq!(state(&c, "j-1.3"), JobState::Cancelled);
    c.check().unwrap();
}

/// One rack of two 4-CPU nodes; a 4-CPU job with a 100 s timeout runs on
/// one of them, so a gang of two 4-CPU members waits and reserves both
/// nodes until it ends. A single job without a timeout may not take the
/// free node (held, kind gang_reservation); one with a 50 s timeout ends
/// before the reservation's start and backfills there. When both end, the
/// gang starts.
#[test]
fn reservation_blocks_a_long_single_job_but_lets_a_short_one_backfill() {
    let mut c = cluster();
    node(&mut c, "n1", "r1", 0);
    node(&mut c, "n2", "r1", 0);
    let (first, _) = submit(&mut c, single(4, 100), 1_000);
    let busy_node = node_of(&c, &first[0]);
    report(&mut c, &busy_node, &first[0], 1, JobState::Running, 1_000);
    let (g, fx) = submit(&mut c, gang(2, Within::Rack, 4), 2_000);
    assert!(assigns(&fx).is_empty());
    let why = c.pending_reason(&g[0], 2_000).unwrap();
    assert_eq!(why.kind, PendingReasonKind::GangReservation as i32);
    assert_eq!(why.until_ms, 101_000, "{why:?}");
    let held = c.gangs().reservation().unwrap();
    assert_eq!(held.nodes, ["n1", "n2"]);

    let (long, fx) = submit(&mut c, single(4, 0), 3_000);
    assert!(assigns(&fx).is_empty(), "{:?}", assigns(&fx));
    assert_eq!(state(&c, &long[0]), JobState::Pending);
    assert_eq!(
        kind(&c, &long[0], 3_000),
        PendingReasonKind::GangReservation
    );
    let (short, fx) = submit(&mut c, single(4, 50), 4_000);
    let free_node = if busy_node == "n1" { "n2" } else { "n1" };
    assert_eq!(
        assigns(&fx),
        vec![(free_node.to_string(), short[0].clone())]
    );

    report(&mut c, free_node, &short[0], 1, JobState::Running, 4_000);
    report(&mut c, free_node, &short[0], 1, JobState::Succeeded, 30_000);
    assert_eq!(state(&c, &g[0]), JobState::Pending, "n1 is still busy");
    let fx = report(
        &mut c,
        &busy_node,
        &first[0],
        1,
        JobState::Succeeded,
        60_000,
    );
    let mut sent = assigns(&fx);
    sent.sort();
    assert_eq!(
        sent,
        vec![
            ("n1".to_string(), "j-2.0".to_string()),
            ("n2".to_string(), "j-2.1".to_string())
        ],
        "the gang, not the long job, gets the freed nodes"
    );
    assert_eq!(state(&c, &long[0]), JobState::Pending);
    assert!(c.gangs().reservation().is_none());
}

/// A job that would have ended in time when it was placed, but waited in
/// a reserved node's queue until after that, is refused when it would
/// start: n1 runs a job until 101 s, so the gang reserves n1 and n2 from
/// then; B (50 s) backfills n2 at once; C (60 s) fits in time when placed
/// at 5 s but can only start at 60 s when B ends, and would then run past
/// 101 s: it is not started, and waits for the gang.
#[test]
fn a_backfill_job_that_would_start_too_late_is_refused_at_its_start() {
    let mut c = cluster();
    node(&mut c, "n1", "r1", 0);
    node(&mut c, "n2", "r1", 0);
    let (a, _) = submit(&mut c, single(4, 100), 1_000);
    report(&mut c, "n1", &a[0], 1, JobState::Running, 1_000);
    let (g, _) = submit(&mut c, gang(2, Within::Rack, 4), 2_000);
    let (b, fx) = submit(&mut c, single(4, 50), 4_000);
    assert_eq!(assigns(&fx), vec![("n2".to_string(), b[0].clone())]);
    report(&mut c, "n2", &b[0], 1, JobState::Running, 4_000);
    let (late, fx) = submit(&mut c, single(4, 60), 5_000);
    assert!(assigns(&fx).is_empty());
    let fx = report(&mut c, "n2", &b[0], 1, JobState::Succeeded, 60_000);
    assert!(assigns(&fx).is_empty(), "{:?}", assigns(&fx));
    assert_eq!(state(&c, &late[0]), JobState::Pending);
    assert_eq!(
        kind(&c, &late[0], 60_000),
        PendingReasonKind::GangReservation
    );
    let fx = report(&mut c, "n1", &a[0], 1, JobState::Succeeded, 101_000);
    let mut sent: Vec<String> = assigns(&fx).into_iter().map(|(_, j)| j).collect();
    sent.sort();
    assert_eq!(sent, g);
}

/// A job kept off the reserved nodes while the gang waited may use them
/// again once the reservation is gone: rack r1 (n1, n2) is reserved for
/// the gang, so a job without a timeout queues on r2's n3 only; when the
/// gang has started and a member ended, its node takes that job.
#[test]
fn a_job_kept_off_reserved_nodes_uses_them_once_the_reservation_is_gone() {
    let mut c = cluster();
    node(&mut c, "n1", "r1", 0);
    node(&mut c, "n2", "r1", 0);
    node(&mut c, "n3", "r2", 0);
    let (first, _) = submit(&mut c, single(4, 100), 1_000);
    assert_eq!(node_of(&c, &first[0]), "n1");
    let (g, _) = submit(&mut c, gang(2, Within::Rack, 4), 2_000);
    assert_eq!(c.gangs().reservation().unwrap().nodes, ["n1", "n2"]);
    let (blocker, _) = submit(&mut c, single(4, 0), 3_000);
    assert_eq!(node_of(&c, &blocker[0]), "n3");
    let (long, _) = submit(&mut c, single(4, 0), 4_000);
    assert_eq!(state(&c, &long[0]), JobState::Pending);
    assert_eq!(c.phase(&long[0]).and_then(|p| p.node()), Some("n3"));
    let fx = report(&mut c, "n1", &first[0], 1, JobState::Succeeded, 5_000);
    assert_eq!(assigns(&fx).len(), 2, "the gang starts: {:?}", assigns(&fx));
    assert!(c.gangs().reservation().is_none());
    let (g0, g1) = (node_of(&c, &g[0]), node_of(&c, &g[1]));
    // The first member to end frees a node of r1: the long job goes there.
    let fx = report(&mut c, &g0, &g[0], 1, JobState::Succeeded, 6_000);
    let sent = assigns(&fx);
    assert_eq!(sent.len(), 1, "{sent:?}");
    assert_eq!(sent[0].1, long[0]);
    assert_eq!(sent[0].0, g0);
    report(&mut c, &g1, &g[1], 1, JobState::Succeeded, 7_000);
}

/// Racks r1 and r2 of one node each: a gang of 2 preferring one rack
/// waits until its relax_after_ms passes, then starts across the racks;
/// the same gang with the rack required never does.
#[test]
fn preferred_relaxes_after_the_wait() {
    for preferred in [true, false] {
        let mut c = cluster();
        node(&mut c, "a", "r1", 0);
        node(&mut c, "b", "r2", 0);
        let mut spec = gang(2, Within::Rack, 1);
        if preferred {
            spec.within_preferred = true;
            spec.relax_after_ms = 10_000;
        }
        let (ids, fx) = submit(&mut c, spec, 1_000);
        assert!(assigns(&fx).is_empty());
        let why = c.pending_reason(&ids[0], 1_000).unwrap();
        assert_eq!(
            why.message.contains("placed anywhere in 10 s"),
            preferred,
            "{why:?}"
        );
        for (now, started) in [(5_000, false), (10_999, false), (11_000, preferred)] {
            for n in ["a", "b"] {
                c.load_report(n, NodeLoad::default(), now, &mut Effects::default());
            }
            let mut fx = Effects::default();
            c.tick(now, &mut fx);
            c.check().unwrap();
            assert_eq!(assigns(&fx).len(), if started { 2 } else { 0 }, "at {now}");
            assert_eq!(state(&c, &ids[1]) == JobState::Assigned, started);
        }
    }
}

/// A gang of 2 on a rack of 3 nodes, with one retry: the first member's
/// node stops reporting. Restart-all: both members go back (the healthy
/// one is told to cancel attempt 1) and start again together as attempt 2
/// on the two live nodes. Replace-member: only the lost member moves, to
/// the free node of the rack (not to r2's), the other keeps running; with
/// no free node left in the rack, the gang restarts; and past its retries
/// a loss ends the gang.
#[test]
fn member_loss_restart_all_and_replace() {
    for replace in [false, true] {
        let mut c = cluster();
        for (n, r) in [("a1", "r1"), ("a2", "r1"), ("a3", "r1"), ("b1", "r2")] {
            node(&mut c, n, r, 0);
        }
        let mut spec = gang(2, Within::Rack, 4);
        spec.retries = 1;
        if replace {
            spec.gang_retry = GangRetry::ReplaceMember as i32;
        }
        let (ids, _) = submit(&mut c, spec, 100);
        let (n0, n1) = (node_of(&c, &ids[0]), node_of(&c, &ids[1]));
        assert_eq!(
            (rack_of(&c, &ids[0]), rack_of(&c, &ids[1])),
            ("r1".into(), "r1".into())
        );
        report(&mut c, &n0, &ids[0], 1, JobState::Running, 200);
        report(&mut c, &n1, &ids[1], 1, JobState::Running, 200);
        // Everyone but n0 keeps reporting; n0 is overdue at 3,001 ms.
        for n in ["a1", "a2", "a3", "b1"] {
            if n != n0 {
                c.load_report(n, NodeLoad::default(), 3_500, &mut Effects::default());
            }
        }
        let mut fx = Effects::default();
        c.tick(3_600, &mut fx);
        c.check().unwrap();
        let spare = ["a1", "a2", "a3"]
            .into_iter()
            .find(|n| *n != n0 && *n != n1)
            .unwrap();
        if replace {
            assert_eq!(assigns(&fx), vec![(spare.to_string(), ids[0].clone())]);
            assert_eq!(c.get_job(&ids[0]).unwrap().attempt, 2);
            assert_eq!(state(&c, &ids[1]), JobState::Running);
            assert_eq!(c.get_job(&ids[1]).unwrap().attempt, 1);
            assert!(!cancels(&fx).iter().any(|(n, _, _)| *n == n1), "{fx:?}");
        } else {
            assert!(
                cancels(&fx).contains(&(n1.clone(), ids[1].clone(), 1)),
                "{:?}",
                cancels(&fx)
            );
            let mut sent: Vec<String> = assigns(&fx).into_iter().map(|(n, _)| n).collect();
            sent.sort();
            let mut want = vec![n1.clone(), spare.to_string()];
            want.sort();
            assert_eq!(sent, want, "both members restart together");
            for id in &ids {
                assert_eq!(c.get_job(id).unwrap().attempt, 2);
                assert_eq!(state(&c, id), JobState::Assigned);
            }
        }
        // A second loss is past the one retry: the lost member ends LOST
        // and the rest of the gang is cancelled.
        let lost = node_of(&c, &ids[0]);
        for n in ["a1", "a2", "a3", "b1"] {
            if n != lost && n != n0 {
                c.load_report(n, NodeLoad::default(), 6_000, &mut Effects::default());
            }
        }
        let mut fx = Effects::default();
        c.tick(6_700, &mut fx);
        c.check().unwrap();
        assert_eq!(state(&c, &ids[0]), JobState::Lost);
        assert!(c.get_job(&ids[1]).unwrap().cancel_requested);
    }
}

/// Replace-member with no free node in the gang's rack falls back to
/// restart-all, which finds room in another rack.
#[test]
fn replace_without_room_in_the_domain_restarts_the_gang() {
    let mut c = cluster();
    for (n, r) in [("a1", "r1"), ("a2", "r1"), ("b1", "r2"), ("b2", "r2")] {
        node(&mut c, n, r, 0);
    }
    let mut spec = gang(2, Within::Rack, 4);
    spec.retries = 1;
    spec.gang_retry = GangRetry::ReplaceMember as i32;
    let (ids, _) = submit(&mut c, spec, 100);
    let rack = rack_of(&c, &ids[0]);
    let lost = node_of(&c, &ids[0]);
    for n in ["a1", "a2", "b1", "b2"] {
        if n != lost {
            c.load_report(n, NodeLoad::default(), 3_500, &mut Effects::default());
        }
    }
    let mut fx = Effects::default();
    c.tick(3_600, &mut fx);
    c.check().unwrap();
    assert_eq!(assigns(&fx).len(), 2, "{:?}", assigns(&fx));
    assert_ne!(rack_of(&c, &ids[0]), rack);
    assert_eq!(rack_of(&c, &ids[0]), rack_of(&c, &ids[1]));
}

/// A member that fails ends the gang: the others are told to cancel and
/// end CANCELLED; a waiting member of a failed gang never starts.
#[test]
fn a_failed_member_cancels_the_others() {
    let mut c = cluster();
    node(&mut c, "a1", "r1", 0);
    node(&mut c, "a2", "r1", 0);
    let (ids, _) = submit(&mut c, gang(2, Within::Rack, 1), 1);
    let (n0, n1) = (node_of(&c, &ids[0]), node_of(&c, &ids[1]));
    let fx = report(&mut c, &n0, &ids[0], 1, JobState::Failed, 5);
    assert_eq!(cancels(&fx), vec![(n1.clone(), ids[1].clone(), 1)]);
    report(&mut c, &n1, &ids[1], 1, JobState::Cancelled, 6);
    assert_eq!(state(&c, &ids[1]), JobState::Cancelled);
    // A gang still waiting when a member is cancelled ends entirely.
    let (w, _) = submit(&mut c, gang(3, Within::Rack, 1), 7);
    let mut fx = Effects::default();
    c.cancel(&w[1], 8, &mut fx).unwrap();
    assert_eq!(state(&c, &w[0]), JobState::Cancelled);
    assert!(
        c.get_job(&w[2])
            .unwrap()
            .reason
            .contains("gang member j-2.1")
    );
    c.check().unwrap();
}

/// Gangs survive a dispatcher restart: the grouping is rebuilt from the
/// persisted members, a waiting gang still starts all at once, and a
/// running one's members come back from their nodes.
#[test]
fn gangs_survive_a_restart() {
    let mut c = cluster();
    node(&mut c, "a1", "r1", 0);
    node(&mut c, "a2", "r1", 0);
    let (running, _) = submit(&mut c, gang(2, Within::Rack, 2), 1);
    let (waiting, _) = submit(&mut c, gang(2, Within::Rack, 4), 2);
    assert_eq!(state(&c, &waiting[0]), JobState::Pending);
    let snap = Snapshot {
        jobs: c.jobs_matching(&[]),
        node_admin: HashMap::new(),
        next_job: 3,
    };
    let mut d = cluster();
    d.restore(snap, 100, 5_000);
    assert_eq!(d.gangs().get(1).map(|g| g.size), Some(2));
    assert_eq!(d.gangs().get(2).map(|g| g.size), Some(2));
    let mut fx = Effects::default();
    for n in ["a1", "a2"] {
        let jobs = running
            .iter()
            .filter(|id| node_of(&c, id) == n)
            .map(|id| JobStatus {
                job_id: id.clone(),
                attempt: 1,
                state: JobState::Running as i32,
                ..Default::default()
            })
            .collect();
        super::tests::register_node_with_jobs(
            &mut d,
            n,
            "1s:4c:1t",
            ("z1", "r1"),
            jobs,
            200,
            &mut fx,
        );
    }
    d.settle(200, &mut fx);
    d.check().unwrap();
    assert!(assigns(&fx).is_empty(), "{:?}", assigns(&fx));
    for id in &running {
        assert_eq!(state(&d, id), JobState::Running);
    }
    let mut fx = Effects::default();
    for id in &running {
        let n = node_of(&d, id);
        d.job_status(
            &n,
            JobStatus {
                job_id: id.clone(),
                attempt: 1,
                state: JobState::Succeeded as i32,
                ..Default::default()
            },
            300,
            &mut fx,
        );
    }
    d.check().unwrap();
    let mut sent: Vec<String> = assigns(&fx).into_iter().map(|(_, j)| j).collect();
    sent.sort();
    assert_eq!(sent, waiting);
}

/// One step of the property test.
#[derive(Clone, Debug)]
enum Op {
    /// A single job: CPUs, timeout (s).
    Single(u32, u64),
    /// A gang: members, within a rack (else a zone), CPUs, replace.
    Gang(u32, bool, u32, bool),
    /// The n-th job holding a node (in id order) ends, succeeded or not.
    Finish(usize, bool),
    /// Node i stops reporting; the others report; a tick past its deadline.
    Lose(usize),
    /// Everyone reports and a tick passes.
    Tick,
    /// A preferred gang within a rack: members, CPUs, relax after (s),
    /// timeout (s).
    Preferred(u32, u32, u64, u64),
    /// Nobody reports; a tick this many ms later.
    Idle(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (1u32..=4, prop::option::of(1u64..100)).prop_map(|(c, t)| Op::Single(c, t.unwrap_or(0))),
        (2u32..=4, any::<bool>(), 1u32..=4, any::<bool>())
            .prop_map(|(n, r, c, x)| Op::Gang(n, r, c, x)),
        (0usize..16, any::<bool>()).prop_map(|(i, ok)| Op::Finish(i, ok)),
        (0usize..6).prop_map(Op::Lose),
        Just(Op::Tick),
    ]
}

/// The nodes of the property tests: racks r1 (a1-a3), r2 (b1, b2) in
/// zone z1, r3 (c1) in z2.
const NAMES: [&str; 6] = ["a1", "a2", "a3", "b1", "b2", "c1"];

/// A cluster of [`NAMES`], 4 CPUs each.
fn gang_cluster() -> Cluster {
    let mut c = cluster();
    let racks = ["r1", "r1", "r1", "r2", "r2", "r3"];
    for (n, r) in NAMES.iter().zip(racks) {
        let mut fx = Effects::default();
        let zone = if r == "r3" { "z2" } else { "z1" };
        register_node(&mut c, n, "1s:4c:1t", (zone, r), 0, &mut fx);
        c.settle(0, &mut fx);
    }
    c
}

/// Apply one step at `now` (moved on by the steps that wait), with the
/// nodes that still report in `alive`.
fn apply_op(c: &mut Cluster, op: Op, now: &mut i64, alive: &mut [bool; 6]) -> Effects {
    let mut fx = Effects::default();
    match op {
        Op::Single(cpus, t) => {
            c.submit(vec![single(cpus, t)], false, *now, &mut fx)
                .unwrap();
        }
        Op::Gang(n, rack, cpus, replace) => {
            let mut spec = gang(n, if rack { Within::Rack } else { Within::Zone }, cpus);
            spec.retries = 2;
            if replace {
                spec.gang_retry = GangRetry::ReplaceMember as i32;
            }
            c.submit(vec![spec], false, *now, &mut fx).unwrap();
        }
        Op::Preferred(n, cpus, relax_s, timeout_s) => {
            let mut spec = gang(n, Within::Rack, cpus);
            spec.within_preferred = true;
            spec.relax_after_ms = relax_s * 1_000;
            spec.timeout_ms = timeout_s * 1_000;
            c.submit(vec![spec], false, *now, &mut fx).unwrap();
        }
        Op::Finish(i, ok) => {
            let holding: Vec<Job> = c
                .jobs_matching(&[])
                .into_iter()
                .filter(|j| {
                    matches!(
                        JobState::try_from(j.state),
                        Ok(JobState::Assigned | JobState::Running)
                    )
                })
                .collect();
            if let Some(j) = holding.get(i % holding.len().max(1)) {
                let state = if ok {
                    JobState::Succeeded
                } else {
                    JobState::Failed
                };
                let status = JobStatus {
                    job_id: j.id.clone(),
                    attempt: j.attempt,
                    state: state as i32,
                    ..Default::default()
                };
                c.job_status(&j.node.clone(), status, *now, &mut fx);
            }
        }
        Op::Lose(i) => {
            alive[i] = false;
            *now += 4_000;
            for (k, n) in NAMES.iter().enumerate() {
                if alive[k] {
                    c.load_report(n, NodeLoad::default(), *now, &mut fx);
                }
            }
            c.tick(*now, &mut fx);
        }
        Op::Tick => {
            for (k, n) in NAMES.iter().enumerate() {
                if alive[k] {
                    c.load_report(n, NodeLoad::default(), *now, &mut fx);
                }
            }
            c.tick(*now, &mut fx);
        }
        Op::Idle(ms) => {
            *now += ms as i64;
            c.tick(*now, &mut fx);
        }
    }
    fx
}

/// The body of `no_partial_gang_ever_holds_cpus`: apply `ops` and check
/// every invariant after each step.
fn run_gang_ops(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let mut c = gang_cluster();
    let mut alive = [true; 6];
    let mut now = 0i64;
    for op in ops {
        let op_shown = op.clone();
        now += 1_000;
        apply_op(&mut c, op, &mut now, &mut alive);
        prop_assert_eq!(c.check(), Ok(()), "after {:?}", op_shown);
        // Oracle for the CPUs: the model's busy CPUs are the CPUs of
        // the jobs holding each node.
        let mut held: HashMap<String, u32> = HashMap::new();
        for j in c.jobs_matching(&[]) {
            let holds = matches!(
                JobState::try_from(j.state),
                Ok(JobState::Assigned | JobState::Running)
            );
            if holds {
                *held.entry(j.node.clone()).or_default() +=
                    j.spec.as_ref().map_or(1, |s| s.cpus.max(1));
            }
        }
        for n in c.nodes() {
            let busy = n.busy_cpus();
            prop_assert_eq!(
                busy,
                held.get(n.name.as_str()).copied().unwrap_or(0),
                "node {}",
                n.name
            );
        }
    }
    Ok(())
}

/// The steps of the differential test: [`op`]'s, preferred gangs with
/// time limits, and ticks with nothing reported in between (the passes a
/// skip may leave out), over from a tick to a few minutes.
fn skip_op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => op(),
        1 => (2u32..=4, 1u32..=4, 1u64..30, prop::option::of(1u64..200))
            .prop_map(|(n, c, r, t)| Op::Preferred(n, c, r, t.unwrap_or(0))),
        3 => prop_oneof![Just(1_000u64), 1u64..20_000, 20_000u64..200_000].prop_map(Op::Idle),
    ]
}

/// What a step did, comparably: its moves and job events, the nodes told
/// something, and every job's state, node, reason and times after it.
fn seen(c: &Cluster, fx: &Effects) -> String {
    let told: Vec<&str> = fx.to_agents.iter().map(|(n, _)| n.as_str()).collect();
    let jobs: Vec<String> = c
        .jobs_matching(&[])
        .into_iter()
        .map(|j| {
            format!(
                "{} {} {} {:?} {} {:?} {} {} {}",
                j.id,
                j.state,
                j.node,
                j.cpus,
                j.attempt,
                j.pending_reason,
                j.start_time_ms,
                j.end_time_ms,
                j.reason
            )
        })
        .collect();
    format!(
        "moves {:?}\nevents {:?}\ntold {told:?}\njobs {jobs:#?}\nreservation {:?}",
        fx.moves,
        fx.events,
        c.gangs.reservation()
    )
}

/// The body of `skipping_unchanged_passes_decides_the_same`: the same
/// steps on a cluster that skips gang passes whose inputs did not change
/// and on one that runs every pass; every step's effects must match.
/// Returns the passes skipped.
fn run_skip_diff(ops: Vec<Op>) -> Result<u64, TestCaseError> {
    let mut fast = gang_cluster();
    let mut every = gang_cluster();
    every.gangs.set_skip_unchanged(false);
    let (mut now_f, mut now_e) = (0i64, 0i64);
    let (mut alive_f, mut alive_e) = ([true; 6], [true; 6]);
    for op in ops {
        let op_shown = op.clone();
        now_f += 1_000;
        now_e += 1_000;
        let fx_f = apply_op(&mut fast, op.clone(), &mut now_f, &mut alive_f);
        let fx_e = apply_op(&mut every, op, &mut now_e, &mut alive_e);
        prop_assert_eq!(
            seen(&fast, &fx_f),
            seen(&every, &fx_e),
            "after {:?} at {}",
            op_shown,
            now_f
        );
    }
    prop_assert_eq!(every.gangs.skipped(), 0);
    Ok(fast.gangs.skipped())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// A gang pass is skipped only when it would decide what the last
    /// one did: with the skip and without it, every step (submissions,
    /// ends, lost nodes, preferred gangs relaxing, reservations whose
    /// ready times and backfill limits pass, idle ticks) has the same
    /// effects and leaves every job the same.
    #[test]
    fn skipping_unchanged_passes_decides_the_same(
        ops in prop::collection::vec(skip_op(), 1..60)
    ) {
        run_skip_diff(ops)?;
    }

    /// Whatever is submitted, finished or lost, no gang ever holds CPUs
    /// with only part of its live members (checked after every step by
    /// brute force over the job table, `Cluster::check_gangs`, together
    /// with the other invariants of `Cluster::check`), and the CPUs the
    /// model marks busy are exactly those of the jobs holding nodes.
    #[test]
    fn no_partial_gang_ever_holds_cpus(ops in prop::collection::vec(op(), 1..40)) {
        run_gang_ops(ops)?;
    }
}

/// The sequence the proptest shrank to when `Cluster::check` first
/// compared every node's room in the engine with the model's: after a
/// gang member's node was lost, node b1's room in the engine stayed
/// below what its model said was free (a job that fits would wait).
#[test]
fn the_engine_keeps_a_nodes_room_after_a_lost_gang_member() {
    use Op::*;
    run_gang_ops(vec![
        Gang(2, false, 1, false),
        Lose(0),
        Finish(0, false),
        Gang(2, false, 2, false),
        Gang(4, false, 2, false),
        Lose(5),
        Finish(0, false),
        Finish(4, false),
        Single(3, 0),
        Gang(2, true, 2, false),
        Single(1, 0),
    ])
    .unwrap();
}

/// The sequence `no_partial_gang_ever_holds_cpus` found at 1,500 cases
/// (seed `cc c7ca7262...`): after the last single job, node a1's room in
/// the engine was 1 CPU below what its model said was free.
#[test]
fn the_engine_keeps_a_nodes_room_after_gangs_wait_and_start() {
    use Op::*;
    run_gang_ops(vec![
        Lose(5),
        Gang(2, false, 1, false),
        Finish(0, false),
        Gang(4, false, 1, false),
        Gang(3, false, 1, false),
        Finish(12, false),
        Finish(1, false),
        Single(2, 0),
        Single(4, 0),
        Gang(3, false, 2, false),
        Gang(2, false, 2, false),
        Single(1, 0),
    ])
    .unwrap();
}

/// A member given back while the nodes are full: the next gang pass
/// cannot replace it and restarts the gang, freeing the other member's
/// node, where a waiting job then starts; that start is claimed (sent,
/// and the node's room in the engine is the model's) in the same pass.
#[test]
fn a_gang_restarted_by_its_pass_claims_the_starts_it_allows() {
    let mut c = cluster();
    node(&mut c, "a", "r1", 0);
    node(&mut c, "b", "r1", 0);
    let (ids, fx) = submit(&mut c, gang(2, Within::Rack, 4), 1);
    assert_eq!(assigns(&fx).len(), 2);
    // One 4-CPU job waits on each node.
    submit(&mut c, single(4, 0), 2);
    submit(&mut c, single(4, 0), 3);
    let given = &ids[0];
    let on = node_of(&c, given);
    let mut fx = Effects::default();
    c.steal_reply(
        &on,
        proto::v1::StealReply {
            job_id: given.clone(),
            attempt: 1,
            released: true,
        },
        4,
        &mut fx,
    );
    let mut fx = Effects::default();
    c.tick(5, &mut fx);
    c.check().unwrap();
    // Both singles hold a node, and were sent.
    for id in ["j-2", "j-3"] {
        assert_eq!(state(&c, id), JobState::Assigned, "{id}");
    }
}

/// The skip does skip: idle ticks over a waiting gang that cannot start
/// leave its passes out until something changes, and the result is the
/// same as running them.
#[test]
fn idle_ticks_over_a_waiting_gang_skip_its_passes() {
    use Op::*;
    let mut ops = vec![
        Single(4, 100),
        Single(4, 100),
        Single(4, 100),
        Gang(3, true, 2, false),
    ];
    ops.extend(std::iter::repeat_n(Idle(1_000), 20));
    ops.push(Finish(0, true));
    ops.extend(std::iter::repeat_n(Idle(1_000), 5));
    let skipped = run_skip_diff(ops).unwrap();
    assert!(skipped >= 15, "{skipped} passes skipped");
}
