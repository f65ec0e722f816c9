//! Latency classes, packing and wake_wide as the dispatcher drives them
//! (register, submit, finish): which job starts where, read from the
//! `Assign`s sent and the jobs' phases.
//!
//! - Latency-first start (seed 004): a latency-class job (latency_nice
//!   < 0) queued after a batch job starts first when room opens, on its
//!   own node (the node's `pick_next_entity`) and, with
//!   `SchedConfig::latency_pull`, from the node beside it; an idle node's
//!   pull takes the latency job first.
//! - Pack (seed 002): jobs asking for PLACEMENT_POLICY_PACK fill the
//!   lowest-numbered node first.
//!
//! wake_wide at cluster level is tested in `wakers.rs`
//! (`a_fan_out_larger_than_its_rack_goes_wide`).

use proto::v1::{JobSpec, PlacementPolicy};

use super::tests::{assigns, finish_on, node_in_rack as node};
use super::*;

fn cluster(latency_pull: bool) -> Cluster {
    let mut cfg = ClusterConfig::default();
    cfg.engine.latency_pull = latency_pull;
    // One queue per domain also serves the latency class first; off, so
    // that these tests see the latency pull alone.
    cfg.engine.domain_fifo = false;
    Cluster::new(cfg)
}

fn job(cpus: u32, latency_nice: i32, on: Option<&str>) -> JobSpec {
    let mut s = JobSpec {
        command: vec!["true".into()],
        cpus,
        latency_nice,
        ..Default::default()
    };
    if let Some(rack) = on {
        s.node_selector
            .insert("dispatch.io/rack".into(), rack.into());
    }
    s
}

fn submit(c: &mut Cluster, spec: JobSpec, now: i64) -> String {
    let mut fx = Effects::default();
    c.submit(vec![spec], false, now, &mut fx)
        .unwrap()
        .remove(0)
        .id()
}

fn finish(c: &mut Cluster, id: &str, now: i64) -> Effects {
    let node = c.get_job(id).unwrap().node;
    finish_on(c, &node, id, now)
}

fn waiting_on(c: &Cluster, id: &str) -> Option<String> {
    match c.phase(id) {
        Some(Phase::Queued {
            node,
            waiting: true,
            ..
        }) => Some(node.to_string()),
        _ => None,
    }
}

/// One busy 2-CPU node: batch j-2 queued before latency-class j-3; when
/// j-1 ends, j-3 starts and j-2 keeps waiting.
#[test]
fn latency_job_queued_second_starts_first_on_its_node() {
    let mut c = cluster(false);
    node(&mut c, "a", "1s:2c:1t", "r1");
    let j1 = submit(&mut c, job(2, 0, None), 1);
    let j2 = submit(&mut c, job(2, 0, None), 2);
    let j3 = submit(&mut c, job(2, -10, None), 3);
    assert_eq!(waiting_on(&c, &j2).as_deref(), Some("a"));
    assert_eq!(waiting_on(&c, &j3).as_deref(), Some("a"));
    let fx = finish(&mut c, &j1, 10);
    assert_eq!(assigns(&fx), vec![("a".to_string(), j3)]);
    assert_eq!(waiting_on(&c, &j2).as_deref(), Some("a"));
    c.check().unwrap();
}

/// Two busy 2-CPU nodes of one rack: batch j-3 waits on node a (its
/// selector keeps it in rack r1, where both nodes are), latency-class j-4
/// waits on node b, submitted after it. When a's job ends, a starts j-4
/// (pulled from b), not its own j-3. Returns the cluster and the ids.
fn latency_waits_beside(latency_pull: bool) -> (Cluster, Effects, [String; 4]) {
    let mut c = cluster(latency_pull);
    node(&mut c, "a", "1s:2c:1t", "r1");
    node(&mut c, "b", "1s:2c:1t", "r1");
    node(&mut c, "x", "1s:1c:1t", "r2");
    let j1 = submit(&mut c, job(2, 0, Some("r1")), 1);
    let j2 = submit(&mut c, job(2, 0, Some("r1")), 2);
    let j3 = submit(&mut c, job(2, 0, Some("r1")), 3);
    let j4 = submit(&mut c, job(2, -10, None), 4);
    assert_eq!(c.get_job(&j1).unwrap().node, "a");
    assert_eq!(c.get_job(&j2).unwrap().node, "b");
    assert_eq!(waiting_on(&c, &j3).as_deref(), Some("a"));
    assert_eq!(waiting_on(&c, &j4).as_deref(), Some("b"));
    let fx = finish(&mut c, &j1, 10);
    (c, fx, [j1, j2, j3, j4])
}

#[test]
fn room_on_a_node_goes_to_the_latency_job_waiting_beside_it() {
    let (c, fx, [_, _, j3, j4]) = latency_waits_beside(true);
    assert_eq!(assigns(&fx), vec![("a".to_string(), j4.clone())]);
    assert!(matches!(
        c.phase(&j4),
        Some(Phase::Assigned { node, via: Via::Stolen { from, level: StealLevel::SameRack }, .. })
            if node == "a" && from == "b"
    ));
    assert!(
        fx.moves
            .iter()
            .any(|m| m.kind == MoveKind::Stolen(StealLevel::SameRack))
    );
    assert_eq!(waiting_on(&c, &j3).as_deref(), Some("a"));
    assert_eq!(c.engine().unwrap().stats().latency_pull, 1);
    c.check().unwrap();
}

/// Without the pull the node runs its own batch job and the latency job
/// keeps waiting beside it (what the test above would see if the
/// mechanism broke).
#[test]
fn without_the_pull_the_node_runs_its_own_batch_job() {
    let (c, fx, [_, _, j3, j4]) = latency_waits_beside(false);
    assert_eq!(assigns(&fx), vec![("a".to_string(), j3)]);
    assert_eq!(waiting_on(&c, &j4).as_deref(), Some("b"));
}

/// Three 2-CPU nodes of one rack, all busy; batch j-4 waits on a,
/// latency-class j-5 (submitted after it) on b. Node c's job ends and c
/// goes idle: its pull takes j-5, although seed 000's search from c's
/// position meets a (and j-4) first.
#[test]
fn an_idle_node_pulls_the_latency_job_first() {
    for pull in [true, false] {
        let mut c = cluster(pull);
        for n in ["a", "b", "c"] {
            node(&mut c, n, "1s:2c:1t", "r1");
        }
        let busy: Vec<String> = (0..3).map(|t| submit(&mut c, job(2, 0, None), t)).collect();
        let j4 = submit(&mut c, job(2, 0, None), 3);
        let j5 = submit(&mut c, job(2, -10, None), 4);
        assert_eq!(c.get_job(&busy[2]).unwrap().node, "c");
        assert_eq!(waiting_on(&c, &j4).as_deref(), Some("a"));
        assert_eq!(waiting_on(&c, &j5).as_deref(), Some("b"));
        let fx = finish(&mut c, &busy[2], 10);
        let (took, left) = if pull { (&j5, &j4) } else { (&j4, &j5) };
        assert_eq!(
            assigns(&fx),
            vec![("c".to_string(), took.clone())],
            "latency_pull {pull}"
        );
        assert!(waiting_on(&c, left).is_some(), "latency_pull {pull}");
        c.check().unwrap();
    }
}

/// Seed 002 at cluster level: jobs asking for the pack policy go to the
/// lowest-numbered node with room (the engine's first leaf), filling it
/// before the next, whatever order the nodes registered in, while
/// spread jobs go to the idlest node.
#[test]
fn pack_fills_the_lowest_node_first() {
    let mut c = cluster(false);
    node(&mut c, "b2", "1s:4c:1t", "r2");
    node(&mut c, "a2", "1s:4c:1t", "r1");
    node(&mut c, "b1", "1s:4c:1t", "r2");
    node(&mut c, "a1", "1s:4c:1t", "r1");
    let order: Vec<String> = c.engine.order().iter().map(|n| n.to_string()).collect();
    let mut packed = job(1, 0, None);
    packed.policy = PlacementPolicy::Pack as i32;
    // A spread job first: it takes an idle node, not necessarily the
    // lowest; the packed ones then fill the lowest node's room.
    let spread = submit(&mut c, job(1, 0, None), 1);
    let spread_node = c.get_job(&spread).unwrap().node;
    let mut placed = Vec::new();
    for t in 0..6 {
        let id = submit(&mut c, packed.clone(), 2 + t);
        placed.push(c.get_job(&id).unwrap().node);
    }
    // Fill order: node by node in the engine's order, 4 CPUs each,
    // less the spread job's CPU.
    let mut expected = Vec::new();
    for n in &order {
        let room = if *n == spread_node { 3 } else { 4 };
        expected.extend(std::iter::repeat_n(n.clone(), room));
    }
    expected.truncate(6);
    assert_eq!(placed, expected, "engine order {order:?}");
    let stats = *c.engine().unwrap().stats();
    assert_eq!(stats.pack_placed, 6, "{stats:?}");
}
